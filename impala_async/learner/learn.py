"""The IMPALA update: V-trace policy gradient, baseline regression and entropy bonus on one batch.

No I/O and no threads here; the server calls :meth:`Learner.step` from its training thread.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core import frames, vtrace
from ..core.models import ModelConfig, build_model
from ..core.spec import TrajectorySpec
from ..ops.config import LearnerConfig
from .metrics import RHO_BIN_EDGES


def model_config(cfg: LearnerConfig) -> ModelConfig:
    """The network the configuration asks for (kind "auto" is resolved against the spec by :class:`Learner`).
    ``cfg.input_scale`` 0 (auto) is resolved by the command line from the observation space; 1/255 here."""
    lstm = cfg.lstm_size if cfg.use_lstm else 0
    scale = cfg.input_scale or 1 / 255
    if cfg.model == "mlp":
        return ModelConfig("mlp", hidden_sizes=cfg.hidden_size_tuple, activation=cfg.activation)
    if cfg.model == "shallow":
        return ModelConfig("conv", input_scale=scale, lstm_size=lstm)
    if cfg.model == "minatar":
        return ModelConfig.minatar(input_scale=scale, lstm_size=lstm)
    if cfg.model == "deep":
        return ModelConfig.deep(input_scale=scale, lstm_size=lstm)
    return ModelConfig(hidden_sizes=cfg.hidden_size_tuple, activation=cfg.activation, input_scale=scale,
                       lstm_size=lstm)


def recurrent_inputs(batch: dict[str, torch.Tensor]) -> tuple[tuple, torch.Tensor]:
    """What the LSTM core unrolls from: the state the actor had at ``obs[0]`` (``core_state [B, 2, H]`` -> ``(h, c)``,
    each ``[B, H]``) and ``starts [B, T+1]``, True where an observation begins an episode (the core is reset there)."""
    core_state = batch["core_state"].float()
    done = (batch["terminated"] != 0) | (batch["truncated"] != 0)  # [B, T]
    starts = torch.cat([torch.zeros_like(done[:, :1]), done], dim=1)  # obs[0]: the actor already reset it
    return (core_state[:, 0], core_state[:, 1]), starts


class Learner:
    def __init__(self, cfg: LearnerConfig, spec: TrajectorySpec, device: torch.device):
        self.cfg = cfg
        self.spec = spec
        self.device = device
        self.model_config = model_config(cfg).resolved(spec)
        if spec.core_state_size != self.model_config.lstm_size:
            raise ValueError(f"the trajectory spec carries a core state of {spec.core_state_size} units, the network "
                             f"has an LSTM core of {self.model_config.lstm_size}")
        self.model = build_model(spec, self.model_config).to(device)
        params = self.model.parameters()
        if cfg.optimizer == "adam":
            self.optimizer = torch.optim.Adam(params, lr=cfg.learning_rate, eps=cfg.adam_eps)
        else:
            self.optimizer = torch.optim.RMSprop(params, lr=cfg.learning_rate, alpha=cfg.rmsprop_alpha,
                                                 eps=cfg.rmsprop_eps, momentum=cfg.rmsprop_momentum)
        self.env_steps_trained = 0
        self.updates = 0
        self.updates_skipped = 0  # batches whose loss or gradient was not finite
        self.inputs_clipped = 0  # values from the wire clipped into their documented range
        self._rho_edges = torch.tensor(RHO_BIN_EDGES[1:], device=device)

    def learning_rate(self) -> float:
        if self.cfg.lr_schedule == "constant":
            return self.cfg.learning_rate
        return self.cfg.learning_rate * max(0.0, 1.0 - self.env_steps_trained / self.cfg.total_env_steps)

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
                obs = bounded(obs, cfg.max_abs_obs)
        B, T1 = obs.shape[:2]
        T = T1 - 1
        state, starts = recurrent_inputs(batch) if self.model.recurrent else ((), None)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
            logits, values = self.model.unroll(obs, state, starts)  # [T+1, B, A], [T+1, B]
        logits, values = logits.float(), values.float()  # everything after the network in fp32

        def tm(name):  # time-major [T, B, ...]
            return batch[name].transpose(0, 1)

        rewards = bounded(tm("reward").float(), cfg.max_abs_reward)
        if cfg.reward_clip > 0:
            rewards = rewards.clamp(-cfg.reward_clip, cfg.reward_clip)
        rewards = rewards * cfg.reward_scale
        truncated = tm("truncated").float()
        done = torch.maximum(tm("terminated").float(), truncated)
        discounts = cfg.discount * (1.0 - done)
        # A time-limit cut is not a terminal state: bootstrap from the value the actor computed for the final
        # observation (the next slot already holds the reset observation).
        rewards = rewards + cfg.discount * truncated * bounded(tm("truncation_value").float(),
                                                               cfg.max_abs_truncation_value)
        behaviour_logits = bounded(tm("behaviour_logits").float(), cfg.max_abs_logit)

        vt = vtrace.from_logits(
            behaviour_policy_logits=behaviour_logits, target_policy_logits=logits[:T], actions=tm("action"),
            discounts=discounts, rewards=rewards, values=values[:T], bootstrap_value=values[T],
            clip_rho_threshold=cfg.threshold(cfg.clip_rho_threshold),
            clip_pg_rho_threshold=cfg.threshold(cfg.clip_pg_rho_threshold),
            clip_c_threshold=cfg.threshold(cfg.clip_c_threshold), lambda_=cfg.vtrace_lambda)
        advantages = vt.pg_advantages
        if cfg.normalize_advantages:
            advantages = advantages / (advantages.std() + 1e-8)
        pg_loss = -(vt.target_action_log_probs * advantages).mean()
        baseline_loss = 0.5 * (vt.vs - values[:T]).pow(2).mean()
        log_probs = F.log_softmax(logits[:T], dim=-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
        loss = pg_loss + cfg.baseline_cost * baseline_loss - cfg.entropy_cost * entropy

        lr = self.learning_rate()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.env_steps_trained += B * T
        # A batch whose loss or gradient is not finite would turn every weight into NaN: skip the update.
        skipped = not bool(torch.isfinite(loss) & torch.isfinite(grad_norm))
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            self.updates_skipped += 1
        else:
            self.optimizer.step()
            self.updates += 1

        with torch.no_grad():
            rhos = vt.log_rhos.exp()
            rho_bar = cfg.clip_rho_threshold if cfg.clip_rho_threshold > 0 else float("inf")
            hist = torch.bincount(torch.bucketize(rhos.flatten(), self._rho_edges), minlength=len(RHO_BIN_EDGES))
            scalars = torch.stack([pg_loss.detach(), baseline_loss.detach(), entropy.detach(), grad_norm.float(),
                                   rhos.mean(), (rhos > rho_bar).float().mean(),
                                   ((rhos < 0.5) | (rhos > 2.0)).float().mean(),  # rho_far_frac: see watch.py
                                   torch.stack(clipped).sum().float()]).tolist()
        names = ("loss_pg", "loss_baseline", "entropy", "grad_norm", "rho_mean", "rho_clipped_frac", "rho_far_frac",
                 "inputs_clipped")
        stats = dict(zip(names, scalars, strict=True))
        stats["lr"] = lr
        stats["rho_hist"] = hist.tolist()
        stats["skipped"] = skipped
        self.inputs_clipped += int(stats["inputs_clipped"])
        return stats

    def parameters_finite(self) -> bool:
        """Whether every weight is finite (checked before weights are published or saved)."""
        with torch.no_grad():
            return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "env_steps_trained": self.env_steps_trained, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.env_steps_trained = int(state["env_steps_trained"])
        self.updates = int(state["updates"])
