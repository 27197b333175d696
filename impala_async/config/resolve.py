"""Resolution: the one step that fills what a config leaves to the run (addresses, logdir, input scale, per-message
and per-connection limits, the number of local actors, the learner's torch threads, the ring's size), after which
nothing changes it.

It needs two facts about the environment, from one environment built as actors build it (:class:`Probe`), and one
about the process, its file-descriptor limit (:func:`fit_connections`, per learner rank).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from ..core.address import port_offset
from . import lockstep
from .layers import RESOLVED, Layered
from .machine import usable_cpus
from .sections import AUTO_SCRATCH_BYTES, IMAGE_THREADS_MIN_VALUES

log = logging.getLogger("impala_async.config.resolve")
FD_RESERVE = 256  # file descriptors kept free of connections: logs, checkpoints, actor pipes, libraries


@dataclass(frozen=True)
class Probe:
    """What resolution needs of the environment."""

    image_max: float | None  # uint8 image observations: the observation space's highest value; None for vectors
    trajectory_nbytes: int  # one trajectory in the ring (core/spec.py)
    obs_values: int = 0  # values in one observation (4 x 84 x 84 for stacked Atari frames)


AUTO_BUFFER_MIN_BYTES, AUTO_BUFFER_MAX_BYTES = 4096, 256 << 10


def auto_buffer_bytes(hwm_messages: int, trajectories_per_message: int, trajectory_nbytes: int) -> int:
    """A kernel socket buffer (SO_SNDBUF, SO_RCVBUF) of about ``hwm_messages`` messages, so that ZeroMQ's high-water
    mark, not the kernel's autotuned buffers (megabytes: hundreds of small messages, each an unroll acted with ever
    older weights), bounds what queues while the learner does not read. 0 (the system's autotuning) for messages so
    large that a fixed buffer of that size could cost throughput (above AUTO_BUFFER_MAX_BYTES)."""
    nbytes = hwm_messages * max(1, trajectories_per_message) * trajectory_nbytes
    return max(AUTO_BUFFER_MIN_BYTES, nbytes) if nbytes <= AUTO_BUFFER_MAX_BYTES else 0


def default_publish(listen: str) -> str:
    """The weights address: tcp on the listen port + 1 (a wildcard port stays one), ipc PATH.weights."""
    if listen.startswith("ipc://"):
        return listen + ".weights"
    return port_offset(listen, 1, "a publish address (give --publish)")


def addresses(cfg, default_listen: str) -> tuple[str, str]:
    """(listen, publish): as configured, or the command's default and the address derived from it."""
    listen = cfg.network.listen or default_listen
    return listen, cfg.network.publish or default_publish(listen)


def resolve(layered: Layered, *, default_listen: str, probe: Probe, now: float | None = None) -> Layered:
    """The finished configuration: each value left to resolution filled and labelled ``resolved``."""
    cfg = layered.cfg
    listen, publish = addresses(cfg, default_listen)
    max_message = cfg.limits.max_trajectories_per_message or min(
        256, max(1, AUTO_SCRATCH_BYTES // probe.trajectory_nbytes)
    )
    values = {
        "listen": listen,
        "publish": publish,
        "logdir": cfg.run.logdir
        or f"runs/{cfg.env.env.replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}",
        # uint8 images to [0, 1]: 1/255 for pixels, 1 for MinAtar's 0/1 planes
        "input_scale": cfg.model.input_scale or 1.0 / max(1.0, probe.image_max or 255.0),
        "max_trajectories_per_message": max_message,
        "max_unread_bytes_per_connection": cfg.limits.max_unread_bytes_per_connection
        or (cfg.network.receive_hwm_messages + 2) * cfg.limits.max_message_bytes,
        "num_actors": cfg.actors.num_actors if cfg.actors.num_actors != -1 else max(1, usable_cpus() - 1),
        "learner_threads": cfg.run.learner_threads or auto_learner_threads(probe),
        "ring_batches": cfg.ring.ring_batches or auto_ring_batches(cfg, max_message),
        # With 0 (auto), as train's actors send: messages of envs_per_actor trajectories (actors/actor.py does the same)
        "receive_buffer_bytes": cfg.network.receive_buffer_bytes
        or auto_buffer_bytes(cfg.network.receive_hwm_messages, cfg.actors.envs_per_actor, probe.trajectory_nbytes),
    }
    flat = cfg.flat()
    changed = {k: v for k, v in values.items() if v != flat[k]}
    return layered.over(RESOLVED, changed)


AUTO_RING_MIN_BATCHES = 8


def auto_ring_batches(cfg, max_message: int) -> int:
    """Batch slots for ``--ring-batches 0``: room for the batch in training, the backlog pace keeps waiting (at least
    one message: transport/pacing.py) and two more messages arriving, and at least AUTO_RING_MIN_BATCHES. A message is
    the largest the learner accepts (``max_message``, which it advertises: an honest actor with that many environments
    sends that many at once), or a train's own actors' ``envs_per_actor`` where that is larger. A ring of 8 batches of
    8 holds two messages of 32 and no more: Pong with ``--batch-size 8`` dropped 8% of what it acted (BENCHMARKS.md,
    section 14), and a learner whose ring held 128 trajectories dropped half of what an actor of 256 environments
    sent. ``--reproducible 1``: at least a round of the lockstep and one batch more (config/lockstep.py)."""
    batch, message = cfg.loss.batch_size, max(max_message, cfg.actors.envs_per_actor)
    backlog = max(cfg.ring.pace_target_batches * batch, message) if cfg.ring.flow_control == "pace" else message
    auto = max(AUTO_RING_MIN_BATCHES, math.ceil((batch + backlog + 2 * message) / batch))
    return max(auto, lockstep.round_batches(cfg) + 1) if cfg.run.reproducible else auto  # a whole round, never a drop


def auto_learner_threads(probe: Probe) -> int:
    """Torch threads for the update on a CPU with ``--learner-threads 0``: two (where the machine has them) for image
    observations of IMAGE_THREADS_MIN_VALUES values or more, else one. Measured on 2 cores (BENCHMARKS.md section 13):
    Pong's Nature-CNN update with a second thread, 1,012 -> 1,075 trained steps/s while the actor kept its core's rest;
    MinAtar's small network, 20,900 -> 17,500 (its operations are too small to split)."""
    images = probe.image_max is not None and probe.obs_values >= IMAGE_THREADS_MIN_VALUES
    return min(2, usable_cpus()) if images else 1


def fit_connections(layered: Layered, local_actors: int) -> Layered:
    """Raise the soft file-descriptor limit to the hard one, and keep both sockets' connections within it with
    FD_RESERVE to spare (lowering ``max_connections`` if need be): peers that open connections by the thousand must
    not leave the learner unable to open a file (its checkpoint writer also keeps its descriptors open in advance).
    Per process (each learner rank has its own limit)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("could not raise the file-descriptor limit from %d to %d: %s", soft, want, e)
    if soft == resource.RLIM_INFINITY:
        return layered
    fit = max(1, (soft - FD_RESERVE - local_actors) // 2)
    current = layered.cfg.limits.max_connections
    if current <= fit:
        return layered
    log.warning(
        "max_connections lowered from %d to %d per socket to fit the file-descriptor limit of %d "
        "(raise it with ulimit -n)",
        current,
        fit,
        soft,
    )
    return layered.over(RESOLVED, {"max_connections": fit})
