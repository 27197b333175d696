"""The learner's network and optimizer, and the update: :meth:`Learner.step` is the pure loss of loss.py applied.

No I/O and no threads here; the training thread (trainer.py) calls :meth:`Learner.step`. With several learner ranks
(:meth:`Learner.distribute`) the gradients are averaged by DistributedDataParallel during backward, and one small
explicit all-reduce per update makes every rank take the same two decisions: skip this update (a rank's loss is not
finite) and stop after it (rank 0 asked).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from ..config import LearnerConfig
from ..core.finite import nonfinite
from ..core.models import ModelConfig, build_model
from ..core.spec import TrajectorySpec
from . import loss
from .reports.histograms import RHO_BIN_EDGES

STAT_NAMES = (
    "loss_pg",
    "loss_baseline",
    "entropy",
    "advantage_abs_mean",
    "value_explained_variance",
    "rho_mean",
    "rho_clipped_frac",
    "rho_far_frac",
)
FUSED_DEVICES = ("cpu", "cuda")  # where torch.optim has Adam's fused kernel and RMSprop's foreach
SWITCH_KEYS = ("foreach", "fused")  # an optimizer parameter group's switches: how it runs, not what it computes


class CollectiveError(RuntimeError):
    """A collective between learner ranks failed (a peer died, left or timed out): raised before the optimizer step,
    so the weights and the optimizer state are still those of the last update, whole."""


def model_config(cfg: LearnerConfig) -> ModelConfig:
    """The network the configuration asks for (kind "auto" is resolved against the spec by :class:`Learner`).
    ``input_scale`` 0 (auto) is resolved with the configuration (config/resolve.py); 1/255 here."""
    m = cfg.model
    if m.model == "mlp":
        return ModelConfig("mlp", hidden_sizes=m.hidden_size_tuple, activation=m.activation)
    named = {"shallow": ModelConfig("conv"), "minatar": ModelConfig.minatar(), "deep": ModelConfig.deep()}
    auto = ModelConfig(hidden_sizes=m.hidden_size_tuple, activation=m.activation)
    return replace(
        named.get(m.model, auto),
        input_scale=m.input_scale or 1 / 255,
        lstm_size=m.lstm_size if m.use_lstm else 0,
        obs_norm=bool(m.obs_norm),
        value_fc=bool(m.value_fc),
    )


class _Unroll(torch.nn.Module):
    """The model as DistributedDataParallel wraps it: its forward is the model's ``unroll`` (what training calls)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, obs, state, starts):
        return self.model.unroll(obs, state, starts)


class Learner:
    def __init__(self, cfg: LearnerConfig, spec: TrajectorySpec, device: torch.device):
        self.hp = cfg.loss
        self.spec = spec
        self.device = device
        self.model_config = model_config(cfg).resolved(spec)
        if spec.core_state_size != self.model_config.lstm_size:
            raise ValueError(
                f"the trajectory spec carries a core state of {spec.core_state_size} units, the network "
                f"has an LSTM core of {self.model_config.lstm_size}"
            )
        self.model = build_model(spec, self.model_config).to(device)
        self.world = 1  # learner ranks training in lock step
        self.optimizer = self._optimizer()
        self.env_steps_trained = 0
        self.updates = 0
        self.updates_skipped = 0  # batches whose loss or gradient was not finite
        self.inputs_clipped = 0  # values from the wire clipped into their documented range
        self._rho_edges = torch.tensor(RHO_BIN_EDGES[1:], device=device)
        # The network's forward pass over a batch: the model's unroll, or with several learner ranks the same through
        # DistributedDataParallel (distribute()), which all-reduces the gradients during backward.
        self.forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] = self.model.unroll
        self.applying = False  # True while the optimizer changes the weights (a checkpoint then would be torn)
        self.apply_lock = threading.Lock()  # held while it does, and while a checkpoint reads them
        self.stop_requested = False  # rank 0: make the next update every rank's last (learner/ranks/)

    def _optimizer(self) -> torch.optim.Optimizer:
        hp, params = self.hp, self.model.parameters()
        if hp.optimizer == "adam":
            return torch.optim.Adam(params, lr=hp.learning_rate, eps=hp.adam_eps, **self.switches)
        return torch.optim.RMSprop(
            params,
            lr=hp.learning_rate,
            alpha=hp.rmsprop_alpha,
            eps=self.per_step(hp.rmsprop_eps),
            momentum=hp.rmsprop_momentum,
            **self.switches,
        )

    @property
    def steps_per_update(self) -> int:
        """``B x T`` x ranks: the env steps whose losses one update averages (the IMPALA paper sums them)."""
        return self.hp.batch_size * self.spec.unroll_length * self.world

    def per_step(self, paper_value: float) -> float:
        """A gradient-scale value in the paper's unit (the loss summed over the batch's steps: the gradient-norm
        clip, RMSprop's epsilon) in this loss's unit, the mean: the gradient of a sum over N steps is N times the
        gradient of their mean, so clipping the mean's gradient at ``c / N`` and RMSprop on it with ``eps / N`` are
        the paper's clip at ``c`` and RMSprop with ``eps``, exactly."""
        return paper_value / self.steps_per_update

    @property
    def switches(self) -> dict:
        """How the optimizer runs, not what it computes: Adam as one fused kernel over all parameters, RMSprop over
        them all at once (foreach), where the device has them. A small network's update spent a fifth of its time
        in the per-parameter loop of the default (MinAtar on a CPU core: 37.7 -> 30.5 us per agent step)."""
        if self.device.type not in FUSED_DEVICES:
            return {}
        return {"fused": True} if self.hp.optimizer == "adam" else {"foreach": True}

    def distribute(self, device_ids=None) -> None:
        """Train in lock step with the other learner ranks of the default process group: gradients are averaged over
        the ranks (DDP, which broadcasts rank 0's weights at once, so every rank starts from the same ones)."""
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        self.forward = DistributedDataParallel(_Unroll(self.model), device_ids=device_ids)
        self.world = dist.get_world_size()
        if self.hp.optimizer == "rmsprop":  # the gradient is now the mean over every rank's steps
            for group in self.optimizer.param_groups:
                group["eps"] = self.per_step(self.hp.rmsprop_eps)

    def counters(self) -> dict:
        return {
            "env_steps_trained": self.env_steps_trained,
            "learner_steps": self.updates,
            "updates_skipped_nonfinite": self.updates_skipped,
            "inputs_clipped": self.inputs_clipped,
        }

    def schedule_progress(self) -> float:
        """How far training is along the learning rate's horizon, ``schedule_env_steps``: 0 to 1 (and 1 after it),
        the same at a given step whatever the run's budget (``total_env_steps``)."""
        return min(1.0, self.env_steps_trained / self.hp.schedule_env_steps)

    def learning_rate(self) -> float:
        if self.hp.lr_schedule == "constant":
            return self.hp.learning_rate
        return self.hp.learning_rate * (1.0 - self.schedule_progress())

    def entropy_cost(self) -> float:
        """``entropy_cost``, or with ``final_entropy_cost`` >= 0 linearly from it to that at
        ``entropy_schedule_env_steps`` env steps trained (0: at ``schedule_env_steps``), and that after."""
        hp = self.hp
        if hp.final_entropy_cost < 0:
            return hp.entropy_cost
        horizon = hp.entropy_schedule_env_steps or hp.schedule_env_steps
        progress = min(1.0, self.env_steps_trained / horizon)
        return hp.entropy_cost + (hp.final_entropy_cost - hp.entropy_cost) * progress

    def step(self, batch: dict[str, torch.Tensor], *, count_steps: bool = True) -> dict:
        """One update from a ring batch of ``B`` trajectories (loss.inputs says its layout); ``count_steps=False``
        for a batch's second and later updates (``updates_per_batch``): its env steps are trained once. Returns
        statistics; ``stats["skipped"]``: the loss or the gradient was not finite and the weights were left unchanged;
        ``stats["last"]``: every rank stops after this update (ranks/). Values from the wire enter the loss clipped
        into their documented ranges (``max_abs_*``); ``stats["inputs_clipped"]`` counts them."""
        entropy_cost, lr = self.entropy_cost(), self.learning_rate()
        x, total, metrics = self._loss(batch, entropy_cost)
        steps, fold = (x.rewards.numel(), x.obs) if count_steps else (0, None)
        skipped, last, grad_norm = self._apply(total, lr, batch_steps=steps, fold=fold)
        scalars = torch.stack([*(metrics[k] for k in STAT_NAMES), grad_norm.float(), x.clipped.float()]).tolist()
        stats = dict(zip((*STAT_NAMES, "grad_norm", "inputs_clipped"), scalars, strict=True))
        stats.update(
            lr=lr, entropy_cost=entropy_cost, rho_hist=metrics["rho_hist"].tolist(), skipped=skipped, last=last
        )
        self.inputs_clipped += int(stats["inputs_clipped"])
        return stats

    def _loss(self, batch: dict[str, torch.Tensor], entropy_cost: float):
        """(inputs, total loss, metrics) of the network on a ring batch: the pure loss of loss.py."""
        x = loss.inputs(batch, self.spec, self.hp, self.model.recurrent)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.hp.precision == "bf16"):
            logits, values = self.forward(x.obs, x.core_state, x.starts)  # [T+1, B, A], [T+1, B]
        total, metrics = loss.impala_loss(logits, values, x, self.hp, entropy_cost, self._rho_edges)
        return x, total, metrics

    def warm_up(self) -> None:
        """On CUDA, one forward and backward pass on a batch of zeros, the weights and the optimizer untouched: the
        device's lazy start (kernels loaded, cuBLAS and cuDNN handles made) would otherwise fall on the first real
        update, seconds in which actors that have no pace yet fill the ring and lose their oldest batches (a CartPole
        actor of 256 environments lost 9% of a short run on an H200). Before :meth:`distribute` (a backward with
        several ranks is collective); nothing elsewhere (a CPU has no such start)."""
        if self.device.type == "cuda":
            self.zero_pass()
            torch.cuda.synchronize(self.device)

    def zero_pass(self) -> None:
        """A forward and backward pass on a batch of zeros ``[B, ...]`` that changes nothing (:meth:`warm_up`)."""
        shapes = {f.name: ((self.hp.batch_size, *f.shape), f.dtype) for f in self.spec.fields}
        batch = {name: torch.from_numpy(np.zeros(*s)).to(self.device) for name, s in shapes.items()}  # [B, ...]
        _, total, _ = self._loss(batch, self.entropy_cost())
        total.backward()
        self.optimizer.zero_grad(set_to_none=True)

    def _apply(
        self, total: torch.Tensor, lr: float, batch_steps: int, fold: torch.Tensor | None = None
    ) -> tuple[bool, bool, torch.Tensor]:
        """Backward, clip, and the optimizer step unless this update is skipped. Returns (skipped, last, grad norm).

        ``fold`` (a batch's observations ``[B, T+1, C, H, W]``, at its first update): a network with an observation
        normaliser folds them into its statistics after the step, under the same lock, so that the batch was
        normalised as its actor normalised it (at lag 0, exactly) and the next weights carry its statistics. With
        several ranks DDP sends rank 0's buffers to every rank at the next forward pass.

        With several ranks every rank backpropagates (DDP averages the gradients during it) and an all-reduce of two
        flags decides, the same on every rank, whether any rank's loss was not finite (all skip) and whether rank 0
        asked to stop after this update (all stop). A non-finite gradient norm is the same on every rank (the
        gradients are): all skip too."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        flags = torch.stack(
            [(~torch.isfinite(total.detach())).float(), torch.tensor(float(self.stop_requested), device=total.device)]
        )
        try:
            total.backward()  # with ranks: DDP all-reduces the gradients here
            flags = self._agree(flags)
        except RuntimeError as e:
            if self.world == 1:
                raise
            raise CollectiveError(f"collective between learner ranks failed: {str(e)[:300]}") from e
        max_norm = self.per_step(self.hp.max_grad_norm) if self.hp.max_grad_norm > 0 else float("inf")
        # reported in the clip's unit, the paper's: the norm of the summed loss's gradient
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm) * self.steps_per_update
        self.env_steps_trained += batch_steps * self.world  # the whole learner's: every rank trained such a batch
        # A batch whose loss or gradient is not finite would turn every weight into NaN: skip the update.
        skipped, last = torch.stack([(flags[0] > 0) | ~torch.isfinite(grad_norm), flags[1] > 0]).tolist()
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            self.updates_skipped += 1
        else:
            with self.apply_lock:
                self.applying = True
                self.optimizer.step()
                norm = getattr(self.model, "obs_norm", None)
                if fold is not None and norm is not None:
                    norm.update(fold.flatten(0, 1).float(), self.model.input_scale)  # [B * (T+1), C, H, W]
                self.updates += 1
                self.applying = False
        return skipped, last, grad_norm

    def _agree(self, flags: torch.Tensor) -> torch.Tensor:
        """``flags [2]`` (this rank's loss is not finite, this rank asks to stop after this update) as every rank
        has them: their maximum over the ranks, by one all-reduce (with one rank, this rank's own)."""
        if self.world == 1:
            return flags
        import torch.distributed as dist

        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags

    def parameters_finite(self) -> bool:
        """Whether every weight is finite (checked before weights are published or saved)."""
        with torch.no_grad():
            return not nonfinite(self.model.named_parameters())

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "env_steps_trained": self.env_steps_trained,
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        # Its groups' switches and epsilon are those of the learner that saved it: this configuration's apply (the
        # learning rate is set at every update).
        saved = state["optimizer"]
        ours = {k: v for k, v in self.optimizer.param_groups[0].items() if k in (*SWITCH_KEYS, "eps")}
        groups = [{**g, **ours} for g in saved["param_groups"]]
        self.optimizer.load_state_dict({**saved, "param_groups": groups})
        self.env_steps_trained = int(state["env_steps_trained"])
        self.updates = int(state["updates"])
