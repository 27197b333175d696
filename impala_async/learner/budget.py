"""What a configuration would allocate, weighed against the machine's memory before anything is allocated.

Sizes are numbers a file or a flag may carry: a huge ``--unroll-length``, ``--batch-size`` or ``--ring-batches`` made
the ring's allocation fail with an allocator traceback, and huge ``--hidden-sizes`` had the process killed by the
kernel's OOM killer once the weights were touched. The two large allocations are known from the configuration and
the trajectory spec alone: the ring (``ring_batches x batch_size`` trajectories, core/spec.py gives their bytes) and
the network with its gradient and the optimizer's state (counted on torch's ``meta`` device, which allocates nothing),
plus one copy of the weights in each local actor. A configuration whose total exceeds the usable memory is refused in
one line naming the fields.
"""

from __future__ import annotations

import torch

from ..config import LearnerConfig
from ..core.models import build_model
from ..core.spec import TrajectorySpec
from .learn import model_config

FLOATS_PER_PARAMETER = 4  # the weight, its gradient, and two optimizer moments (Adam; RMSprop keeps one or two)
FLOAT_BYTES = 4


def network_parameters(cfg: LearnerConfig, spec: TrajectorySpec) -> int:
    """Parameters of the network ``cfg`` describes for ``spec``, counted without allocating them."""
    with torch.device("meta"):
        model = build_model(spec, model_config(cfg).resolved(spec))
    return sum(p.numel() for p in model.parameters())


def memory_refusal(cfg: LearnerConfig, spec: TrajectorySpec, usable_bytes: int) -> str:
    """Why ``cfg`` cannot fit in ``usable_bytes`` ("" if it can)."""
    ring = cfg.ring.ring_batches * cfg.loss.batch_size * spec.trajectory_nbytes
    scratch = cfg.limits.max_trajectories_per_message * spec.trajectory_nbytes  # one message decoded aside (ingest)
    parameters = network_parameters(cfg, spec)
    network = parameters * FLOAT_BYTES * (FLOATS_PER_PARAMETER + max(0, cfg.local_actors))
    if ring + scratch + network <= usable_bytes:
        return ""
    core = f", lstm_size {cfg.model.lstm_size}" if cfg.model.use_lstm else ""
    return (
        f"this configuration needs {_size(ring + scratch + network)}, more than the {_size(usable_bytes)} this "
        f"machine allows: the ring, {_size(ring)} (ring_batches {cfg.ring.ring_batches} x batch_size "
        f"{cfg.loss.batch_size} x {_size(spec.trajectory_nbytes)} a trajectory of unroll_length "
        f"{cfg.env.unroll_length}); one message, {_size(scratch)} (max_trajectories_per_message "
        f"{cfg.limits.max_trajectories_per_message}); the network, {_size(network)} ({parameters:,} parameters with "
        f"their gradient, the optimizer's state and one copy per local actor; hidden_sizes "
        f"{cfg.model.hidden_sizes!r}{core})"
    )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
