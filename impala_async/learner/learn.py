"""The IMPALA update: V-trace policy gradient, baseline regression and entropy bonus on one batch.

No I/O and no threads here; the server calls :meth:`Learner.step` from its training thread.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from ..config import LearnerConfig
from ..core import frames, vtrace
from ..core.models import ModelConfig, build_model
from ..core.spec import TrajectorySpec
from .metrics import RHO_BIN_EDGES


class CollectiveError(RuntimeError):
    """A gradient all-reduce between learner ranks failed (a peer died, left or timed out): raised before the optimizer
    step, so the weights and the optimizer state are still those of the last update, whole."""


def model_config(cfg: LearnerConfig) -> ModelConfig:
    """The network the configuration asks for (kind "auto" is resolved against the spec by :class:`Learner`).
    ``cfg.model.input_scale`` 0 (auto) is resolved by the command line from the observation space; 1/255 here."""
    lstm = cfg.model.lstm_size if cfg.model.use_lstm else 0
    scale = cfg.model.input_scale or 1 / 255
    if cfg.model.model == "mlp":
        return ModelConfig("mlp", hidden_sizes=cfg.model.hidden_size_tuple, activation=cfg.model.activation)
    if cfg.model.model == "shallow":
        return ModelConfig("conv", input_scale=scale, lstm_size=lstm)
    if cfg.model.model == "minatar":
        return ModelConfig.minatar(input_scale=scale, lstm_size=lstm)
    if cfg.model.model == "deep":
        return ModelConfig.deep(input_scale=scale, lstm_size=lstm)
    return ModelConfig(
        hidden_sizes=cfg.model.hidden_size_tuple, activation=cfg.model.activation, input_scale=scale, lstm_size=lstm
    )


def recurrent_inputs(batch: dict[str, torch.Tensor]) -> tuple[tuple, torch.Tensor]:
    """What the LSTM core unrolls from: the state the actor had at ``obs[0]`` (``core_state [B, 2, H]`` -> ``(h, c)``,
    each ``[B, H]``) and ``starts [B, T+1]``, True where an observation begins an episode (the core is reset there)."""
    core_state = batch["core_state"].float()
    done = (batch["terminated"] != 0) | (batch["truncated"] != 0)  # [B, T]
    starts = torch.cat([torch.zeros_like(done[:, :1]), done], dim=1)  # obs[0]: the actor already reset it
    return (core_state[:, 0], core_state[:, 1]), starts


class _Carry(torch.autograd.Function):
    """The identity on ``x``; its backward hands ``value`` to ``carrier`` as its gradient (see Learner.distribute)."""

    @staticmethod
    def forward(ctx, x, carrier, value):
        ctx.save_for_backward(value)
        return x.clone()  # not a view: autograd treats a view of an input returned by a Function specially

    @staticmethod
    def backward(ctx, grad):
        (value,) = ctx.saved_tensors
        return grad, value, None


class Learner:
    def __init__(self, cfg: LearnerConfig, spec: TrajectorySpec, device: torch.device):
        self.cfg = cfg
        self.spec = spec
        self.device = device
        self.model_config = model_config(cfg).resolved(spec)
        if spec.core_state_size != self.model_config.lstm_size:
            raise ValueError(
                f"the trajectory spec carries a core state of {spec.core_state_size} units, the network "
                f"has an LSTM core of {self.model_config.lstm_size}"
            )
        self.model = build_model(spec, self.model_config).to(device)
        params = self.model.parameters()
        if cfg.loss.optimizer == "adam":
            self.optimizer = torch.optim.Adam(params, lr=cfg.loss.learning_rate, eps=cfg.loss.adam_eps)
        else:
            self.optimizer = torch.optim.RMSprop(
                params,
                lr=cfg.loss.learning_rate,
                alpha=cfg.loss.rmsprop_alpha,
                eps=cfg.loss.rmsprop_eps,
                momentum=cfg.loss.rmsprop_momentum,
            )
        self.env_steps_trained = 0
        self.updates = 0
        self.updates_skipped = 0  # batches whose loss or gradient was not finite
        self.inputs_clipped = 0  # values from the wire clipped into their documented range
        self._rho_edges = torch.tensor(RHO_BIN_EDGES[1:], device=device)
        # The network's forward pass over a batch: the model's unroll, or with several learner ranks the same through
        # DistributedDataParallel (distribute()), which all-reduces the gradients during backward.
        self.forward = self.model.unroll
        self.distributed = False
        self.world = 1  # learner ranks training in lock step
        self.applying = False  # True while the optimizer changes the weights (a checkpoint then would be torn)
        self.apply_lock = threading.Lock()  # held while it does, and while a checkpoint reads them
        self.stop_requested = False  # rank 0: flag the next update as every rank's last (ranks.py)
        self.stop_agreed = False  # the latest update carried that flag: every rank stops after it

    def distribute(self, device_ids=None) -> None:
        """Train in lock step with the other learner ranks of the default process group: gradients are averaged over
        the ranks (DDP). DDP wraps a module whose forward is the model's ``unroll`` (what training calls), and
        broadcasts rank 0's weights at once, so every rank starts from the same ones. The module has one more
        parameter, ``stop``, outside the optimizer: its gradient is 1 on a rank that asks every rank to make this
        update its last (rank 0's ``stop_requested``), else 0, and the all-reduce averages it with the others, so every
        rank learns the same answer after the same update without a message of its own."""
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        learner = self

        class Unroll(torch.nn.Module):
            def __init__(self, model):
                super().__init__()
                self.model = model
                self.stop = torch.nn.Parameter(torch.zeros(1, device=learner.device))

            def forward(self, obs, state, starts):
                logits, values = self.model.unroll(obs, state, starts)
                flag = torch.full((1,), float(learner.stop_requested), device=self.stop.device)
                return _Carry.apply(logits, self.stop, flag), values

        self._unroll = Unroll(self.model)
        self.forward = DistributedDataParallel(self._unroll, device_ids=device_ids)
        self.distributed = True
        self.world = dist.get_world_size()

    def learning_rate(self) -> float:
        if self.cfg.loss.lr_schedule == "constant":
            return self.cfg.loss.learning_rate
        return self.cfg.loss.learning_rate * max(0.0, 1.0 - self.env_steps_trained / self.cfg.run.total_env_steps)

    def entropy_cost(self) -> float:
        """``entropy_cost``, or with ``final_entropy_cost`` >= 0 linearly from it to that at ``total_env_steps``."""
        cfg = self.cfg
        if cfg.loss.final_entropy_cost < 0:
            return cfg.loss.entropy_cost
        progress = min(1.0, self.env_steps_trained / cfg.run.total_env_steps)
        return cfg.loss.entropy_cost + (cfg.loss.final_entropy_cost - cfg.loss.entropy_cost) * progress

    def step(self, batch: dict[str, torch.Tensor]) -> dict:
        """One update from a batch of ``B`` trajectories, batch-major as in the ring: ``obs [B, T+1, ...]`` (or
        ``frames [B, T+S, H, W]`` with a frame-stacking spec),
        ``action``/``reward``/``terminated``/``truncated``/``truncation_value`` ``[B, T]``,
        ``behaviour_logits [B, T, A]``. Returns statistics; ``stats["skipped"]`` is True when the loss or the
        gradient was not finite and the weights were left unchanged.

        Values from the wire enter the loss clipped into documented ranges (``max_abs_reward``,
        ``max_abs_truncation_value``, ``max_abs_logit``, ``max_abs_obs``); ``stats["inputs_clipped"]`` counts them."""
        cfg = self.cfg
        clipped = []  # how many values from the wire were clipped into their documented range

        def bounded(x: torch.Tensor, bound: float) -> torch.Tensor:
            clipped.append((x.abs() > bound).sum())
            return x.clamp(-bound, bound)

        if self.spec.frame_stack:
            obs = frames.unstack(batch["frames"], batch["terminated"], batch["truncated"], self.spec.frame_stack)
        else:
            obs = batch["obs"]
            if obs.is_floating_point():
                obs = bounded(obs, cfg.loss.max_abs_obs)
        B, T1 = obs.shape[:2]
        T = T1 - 1
        state, starts = recurrent_inputs(batch) if self.model.recurrent else ((), None)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cfg.loss.precision == "bf16"):
            logits, values = self.forward(obs, state, starts)  # [T+1, B, A], [T+1, B]
        logits, values = logits.float(), values.float()  # everything after the network in fp32

        def tm(name):  # time-major [T, B, ...]
            return batch[name].transpose(0, 1)

        rewards = bounded(tm("reward").float(), cfg.loss.max_abs_reward)
        if cfg.loss.reward_clip > 0:
            rewards = rewards.clamp(-cfg.loss.reward_clip, cfg.loss.reward_clip)
        rewards = rewards * cfg.loss.reward_scale
        truncated = tm("truncated").float()
        done = torch.maximum(tm("terminated").float(), truncated)
        discounts = cfg.loss.discount * (1.0 - done)
        # A time-limit cut is not a terminal state: bootstrap from the value the actor computed for the final
        # observation (the next slot already holds the reset observation).
        rewards = rewards + cfg.loss.discount * truncated * bounded(
            tm("truncation_value").float(), cfg.loss.max_abs_truncation_value
        )
        behaviour_logits = bounded(tm("behaviour_logits").float(), cfg.loss.max_abs_logit)

        vt = vtrace.from_logits(
            behaviour_policy_logits=behaviour_logits,
            target_policy_logits=logits[:T],
            actions=tm("action"),
            discounts=discounts,
            rewards=rewards,
            values=values[:T],
            bootstrap_value=values[T],
            clip_rho_threshold=cfg.loss.threshold(cfg.loss.clip_rho_threshold),
            clip_pg_rho_threshold=cfg.loss.threshold(cfg.loss.clip_pg_rho_threshold),
            clip_c_threshold=cfg.loss.threshold(cfg.loss.clip_c_threshold),
            lambda_=cfg.loss.vtrace_lambda,
        )
        advantages = vt.pg_advantages
        if cfg.loss.normalize_advantages:
            advantages = advantages / (advantages.std() + 1e-8)
        pg_loss = -(vt.target_action_log_probs * advantages).mean()
        baseline_loss = 0.5 * (vt.vs - values[:T]).pow(2).mean()
        log_probs = F.log_softmax(logits[:T], dim=-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
        entropy_cost = self.entropy_cost()
        loss = pg_loss + cfg.loss.baseline_cost * baseline_loss - entropy_cost * entropy

        lr = self.learning_rate()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        if not self.distributed:
            loss.backward()
        else:
            # The ranks must agree to skip: a rank whose loss is not finite makes its gradient NaN (x NaN, never
            # x 0), so the averaged gradient, and with it grad_norm, is NaN on every rank. x 1.0 changes no bit.
            loss = loss * torch.where(torch.isfinite(loss.detach()), 1.0, float("nan"))
            self._unroll.stop.grad = None
            try:
                loss.backward()  # DDP all-reduces the gradients here
            except RuntimeError as e:
                raise CollectiveError(f"gradient all-reduce failed: {str(e)[:300]}") from e
            self.stop_agreed = bool(self._unroll.stop.grad.item() > 0)
        max_norm = cfg.loss.max_grad_norm if cfg.loss.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.env_steps_trained += B * T * self.world  # the whole learner's: every rank trained a batch like this one
        # A batch whose loss or gradient is not finite would turn every weight into NaN: skip the update.
        skipped = not bool(torch.isfinite(loss) & torch.isfinite(grad_norm))
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            self.updates_skipped += 1
        else:
            with self.apply_lock:
                self.applying = True
                self.optimizer.step()
                self.updates += 1
                self.applying = False

        with torch.no_grad():
            rhos = vt.log_rhos.exp()
            rho_bar = cfg.loss.clip_rho_threshold if cfg.loss.clip_rho_threshold > 0 else float("inf")
            hist = torch.bincount(torch.bucketize(rhos.flatten(), self._rho_edges), minlength=len(RHO_BIN_EDGES))
            scalars = torch.stack(
                [
                    pg_loss.detach(),
                    baseline_loss.detach(),
                    entropy.detach(),
                    grad_norm.float(),
                    rhos.mean(),
                    (rhos > rho_bar).float().mean(),
                    ((rhos < 0.5) | (rhos > 2.0)).float().mean(),  # rho_far_frac: see watch.py
                    torch.stack(clipped).sum().float(),
                ]
            ).tolist()
        names = (
            "loss_pg",
            "loss_baseline",
            "entropy",
            "grad_norm",
            "rho_mean",
            "rho_clipped_frac",
            "rho_far_frac",
            "inputs_clipped",
        )
        stats = dict(zip(names, scalars, strict=True))
        stats["lr"] = lr
        stats["entropy_cost"] = entropy_cost
        stats["rho_hist"] = hist.tolist()
        stats["skipped"] = skipped
        self.inputs_clipped += int(stats["inputs_clipped"])
        return stats

    def parameters_finite(self) -> bool:
        """Whether every weight is finite (checked before weights are published or saved)."""
        with torch.no_grad():
            return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "env_steps_trained": self.env_steps_trained,
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.env_steps_trained = int(state["env_steps_trained"])
        self.updates = int(state["updates"])
