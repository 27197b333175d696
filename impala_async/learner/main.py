"""A learner process, from its configuration's layers to an exit code.

:func:`configure` puts the layers together (config/layers.py; with ``--resume`` the checkpoint's configuration is one of
them) and checks them: refusals come before anything heavy is imported. :func:`run` builds one environment as actors
build it (what resolution needs of it), resolves the configuration once (config/resolve.py), joins the other learner
ranks, builds the network (restoring a checkpoint's state), writes ``LOGDIR/config.json`` and serves until the run
ends. A learner rank > 0 takes rank 0's resolved configuration, spec and incarnation instead.
"""

from __future__ import annotations

import logging
import math

from ..config import Layered, LearnerConfig, layers, lockstep
from ..config.resolve import Probe, addresses, fit_connections, resolve
from ..ops import interrupts
from . import ranks

log = logging.getLogger("impala_async.learner.main")


def configure(
    flags: dict, *, file: str = "", resume: str = "", command: dict | None = None, load_checkpoint=None
) -> tuple[Layered, dict | None]:
    """(the configuration's layers, checked; the checkpoint state of a resume, or None). ValueError (a refusal, one
    line) for a bad file or value; SystemExit when a resume finds no usable checkpoint. A learner rank > 0 gets its
    own command line's layers, unchecked and without the resume: it takes rank 0's configuration in :func:`run`.
    ``load_checkpoint(directory, max_bytes)`` finds a resume's (state, path): the newest that passes every check of the
    file alone (resume.load_newest, which sets the others aside); its path goes under ``resume.RESUMED_FROM``."""
    layered, state = layers.load(flags=flags, file=file, command=command), None
    if ranks.env_rank() > 0:  # rank 0's configuration comes later (run); these layers give the rank's start timeout
        return layered, None
    if resume:
        found = load_checkpoint(resume, layered.cfg.checkpoints.max_checkpoint_bytes)
        if found is None:
            raise SystemExit(f"impala-async: no usable checkpoint in {resume} (see the warnings above)")
        from .checkpoint.resume import RESUMED_FROM  # torch: only now, for a checkpoint loaded already

        state, path = found
        state[RESUMED_FROM] = str(path)
        log.info("resuming from %s", path)
        try:
            layered = layers.load(
                flags=flags,
                file=file,
                resumed=state["config"],
                resumed_layers=state.get("config_layers"),
                command={**(command or {}), "logdir": resume},
            )
        except ValueError as e:  # its configuration is valid (validated): with the flags and file, or a permission
            raise ValueError(f"resuming {path}: {e}") from None
    layered = ranks.with_torchrun_world(layered)
    layered.check()
    return layered, state


def refuse(cfg: LearnerConfig, default_listen: str):
    """The CURVE keys to serve with (None without CURVE); ValueError or OSError for what must not start: a bind beyond
    loopback without CURVE, unsafe or missing keys, TensorBoard asked for and not installed."""
    from ..ops import auth

    if cfg.observe.tensorboard:
        from .reports import tboard

        if tboard.missing():
            raise ValueError(tboard.missing())
    listen, publish = addresses(cfg, default_listen)
    auth.refuse_insecure(listen, publish, bool(cfg.network.curve_keys), bool(cfg.network.insecure))
    return auth.load_learner_keys(cfg.network.curve_keys) if cfg.network.curve_keys else None


def probe_environment(cfg: LearnerConfig):
    """(trajectory spec, Probe, env backend chosen) from one environment built as the actors build it."""
    import gymnasium as gym
    import numpy as np

    from ..actors.vec import make_vec
    from ..core import codecs
    from ..core.spec import TrajectorySpec

    env_cfg = cfg.env
    try:
        env = make_vec(env_cfg.env, env_cfg.env_kwargs_dict, 1, env_cfg.env_backend)
    except (TypeError, ValueError) as e:  # an argument the environment (or EnvPool) does not take
        raise SystemExit(f"impala-async: --env {env_cfg.env} --env-kwargs {env_cfg.env_kwargs}: {e}") from None
    except gym.error.DependencyNotInstalled as e:
        raise SystemExit(f"impala-async: {e}") from None
    try:
        spec = TrajectorySpec.from_spaces(
            env.single_observation_space,
            env.single_action_space,
            env_cfg.unroll_length,
            frame_stack=env.frame_stack if env_cfg.frame_dedup else 0,
            core_state_size=cfg.model.lstm_size if cfg.model.use_lstm else 0,
        )
        space = env.single_observation_space  # uint8 observations come in a Box
        image_max = (
            float(np.max(space.high)) if spec.obs_dtype == "uint8" and isinstance(space, gym.spaces.Box) else None
        )
        backend = env.backend
    finally:
        env.close()
    if env_cfg.obs_codec == codecs.CODEC_JPEG and codecs.refusal(spec.fields[0], image_max or 255.0):
        raise SystemExit(f"impala-async: --env {env_cfg.env}: {codecs.refusal(spec.fields[0], image_max or 255.0)}")
    probe = Probe(image_max=image_max, trajectory_nbytes=spec.trajectory_nbytes, obs_values=math.prod(spec.obs_shape))
    return spec, probe, backend


def refuse_oversized(cfg: LearnerConfig, spec) -> None:
    """SystemExit (one line) for sizes this machine's memory cannot hold, before anything is allocated
    (learner/budget.py). A network this observation space cannot take is left to build_learner to refuse."""
    from ..config.machine import usable_memory_bytes
    from .budget import memory_refusal

    try:
        refusal = memory_refusal(cfg, spec, usable_memory_bytes())
    except ValueError:
        return
    if refusal:
        raise SystemExit(f"impala-async: {refusal}")


def resolve_device(name: str, flag: str = "--device"):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"impala-async: {flag} {name} asked for, but torch sees no CUDA device")
    return device


def run(
    layered: Layered, resumed: dict | None, *, command: str, default_listen: str, argv=(), start_monotonic: float = 0.0
) -> int:
    """Serve one learner process until the run ends; its exit code (README, Exit codes)."""
    zygotes: list = []  # the local actors' zygote, forked by _prepare
    interrupts.install()  # a Ctrl-C that start-up swallows still ends it (ops/interrupts.py)
    try:
        return _run(layered, resumed, command, default_listen, argv, start_monotonic, zygotes)
    finally:
        for zygote in zygotes:
            zygote.close()
        interrupts.uninstall()


def _run(layered: Layered, resumed, command: str, default_listen: str, argv, start_monotonic: float, zygotes) -> int:
    group, layered, spec, env_backend, (keys, device) = ranks.join(
        layered,
        resumed,
        list(argv),
        prepare=lambda cfg: _prepare(cfg, default_listen, zygotes),
        resolve=lambda layered: _resolve(layered, default_listen),
    )
    zygote = zygotes[0] if zygotes else None
    cfg = layered.cfg
    if device.type == "cpu":
        import torch

        torch.set_num_threads(cfg.run.learner_threads)  # resolved: config/resolve.py
        log.info("learner: the update runs on %d torch thread(s) (--learner-threads)", torch.get_num_threads())
    layered = fit_connections(layered, group.local_actors(cfg.local_actors))
    lock = group.lead_only(lambda: _own_logdir(layered, command))
    if resumed is not None and cfg.run.reproducible:
        log.warning(
            "--reproducible 1, resumed: this run continues from the checkpoint's state (weights, optimizer, counters), "
            "not exactly as the uninterrupted run would have: the actors' environments and random streams start again "
            "from their seeds"
        )
    try:
        return _serve(layered, spec, env_backend, device, keys, group, start_monotonic, zygote)
    finally:
        if lock is not None:
            lock.release()


def _prepare(cfg: LearnerConfig, default_listen: str, zygotes: list):
    """(the CURVE keys, the learner's device), the random generators seeded: what every rank does first with the
    configuration it runs. A refusal to start (:func:`refuse`) comes before the heavy imports. The local actors'
    zygote (actors/zygote.py) is forked once torch is imported and before anything else: no environment built yet
    (OpenCV's threads), no thread of this process, no generator seeded (an actor's are as a fresh interpreter's)."""
    try:
        keys = refuse(cfg, default_listen)
    except (ValueError, OSError) as e:
        raise SystemExit(f"impala-async: {e}") from None
    device = resolve_device(cfg.run.device)
    if cfg.actors.num_actors != 0 and cfg.actors.options().forks():
        from ..actors.zygote import Zygote

        zygotes.extend([z for z in [Zygote.fork()] if z is not None])
    seed_generators(cfg)
    return keys, device


def seed_generators(cfg: LearnerConfig) -> None:
    """torch's and numpy's generators seeded from the run's seed (the network's initial weights come from torch's);
    with ``--reproducible 1`` torch made to raise, rather than vary, for an operation with no deterministic variant."""
    import numpy as np
    import torch

    torch.manual_seed(cfg.run.seed)
    np.random.seed(cfg.run.seed)
    torch.use_deterministic_algorithms(bool(cfg.run.reproducible))


def _resolve(layered: Layered, default_listen: str):
    """(the layers resolved once, the trajectory spec, the env backend): rank 0's (or a learner of one's) work before
    the ranks join, from one environment built as the actors build it; SystemExit for what this machine cannot run."""
    spec, probe, env_backend = probe_environment(layered.cfg)
    layered = resolve(layered, default_listen=default_listen, probe=probe)
    cfg = layered.cfg
    refuse_oversized(cfg, spec)
    if cfg.local_actors > 0 and cfg.actors.device != "cpu":
        resolve_device(cfg.actors.device, "--actor-device")  # no CUDA device: refused before any actor starts
    refused = lockstep.refusals(cfg, resolve_device(cfg.run.device).type)
    if refused:
        raise SystemExit("impala-async: " + "; ".join(refused))
    return layered, spec, env_backend


def _own_logdir(layered: Layered, command: str):
    """Rank 0's hold on the run directory: its lock (held till the end), the configuration said and written."""
    lock = lock_logdir(layered.cfg.run.logdir)  # before anything is written there
    log.info("%s", layered.describe())
    for warning in layered.cfg.warnings():
        log.warning("%s", warning)
    write_config(layered, command, lock)
    return lock


def write_config(layered: Layered, command: str, lock) -> None:
    """LOGDIR/config.json, or SystemExit in one line (the lock released) where the logdir takes no file: a full or
    read-only disk is refused at start, not met at the first report."""
    try:
        layered.write(layered.cfg.run.logdir, command)
    except OSError as e:
        lock.release()
        raise SystemExit(
            f"impala-async: cannot write to the logdir {layered.cfg.run.logdir} (--logdir): {e.strerror or e}"
        ) from None


def lock_logdir(logdir: str):
    """The run directory's lock (learner/rundir.py), or SystemExit in one line: another learner holds it, or the
    directory cannot be made or written."""
    from .rundir import LogdirInUse, RunDirLock

    try:
        return RunDirLock(logdir)
    except LogdirInUse as e:
        raise SystemExit(f"impala-async: {e}") from None
    except OSError as e:
        raise SystemExit(f"impala-async: cannot use the logdir {logdir} (--logdir): {e.strerror or e}") from None


def _serve(layered: Layered, spec, env_backend: str, device, keys, group, start_monotonic: float, zygote) -> int:
    import uvloop

    from .checkpoint import resume
    from .server import LearnerServer

    cfg = layered.cfg
    device = group.start(device)  # several ranks: the process group, and rank 0's checkpoint state on every rank
    learner, resumed = resume.restore(
        lambda: build_learner(cfg, spec, device), cfg, spec, group.resumed, group.bad_checkpoint
    )
    learner.warm_up()  # CUDA's lazy start before any actor can send
    group.distribute(learner)  # several ranks: gradients averaged over them
    make_actors, keys = _local_actors(cfg, keys, group, zygote)
    server = LearnerServer(
        cfg,
        learner,
        spec,
        run_info(cfg, spec, learner, env_backend),
        start_monotonic=start_monotonic,
        make_actors=make_actors,
        keys=keys,
        resumed=resumed,
        ranks=group,
        config_layers=layered.layers,
    )
    interrupts.reraise_lost()  # a Ctrl-C swallowed since run() began: the start-up ends here, as one not swallowed
    code = uvloop.run(server.serve())
    return group.exit(code, server.exit_reason)


def build_learner(cfg: LearnerConfig, spec, device):
    """A fresh network and optimizer; SystemExit (one line) for a network this observation space cannot take. A
    resumed state is restored into it by resume.restore."""
    from .learn import Learner

    try:
        return Learner(cfg, spec, device)
    except ValueError as e:  # a network this observation space cannot take (an LSTM on vectors, images too small)
        raise SystemExit(f"impala-async: {e}") from None


def run_info(cfg: LearnerConfig, spec, learner, env_backend: str) -> dict:
    """What actors learn of the run from every weights message (docs/protocol.md, run)."""
    from ..core import wire

    return {
        "protocol": wire.PROTOCOL_VERSION,
        "env_id": cfg.env.env,
        "env_kwargs": cfg.env.env_kwargs_dict,
        "spec": spec.to_dict(),
        "model": learner.model_config.to_dict(),
        "max_trajectories_per_message": cfg.limits.max_trajectories_per_message,
        "max_message_bytes": cfg.limits.max_message_bytes,
        "max_episodes_per_message": cfg.limits.max_episodes_per_message,
        "max_actor_id_bytes": cfg.limits.max_actor_id_bytes,
        "obs_codec": cfg.env.obs_codec,
        "jpeg_quality": cfg.env.jpeg_quality,
        "env_backend": env_backend,
        "flow_control": cfg.ring.flow_control,
        "lockstep": bool(cfg.run.reproducible),
    }


def _local_actors(cfg: LearnerConfig, keys, group, zygote):
    """(``make_actors(listen, publish)``: train's local actor processes for the addresses bound, not started, or None;
    the CURVE keys, with theirs admitted)."""
    from pathlib import Path

    from ..actors.procs import ActorProcesses, actor_argv
    from ..ops import auth

    local_dir: Path | str = ""
    if keys is not None and cfg.local_actors > 0:  # local actors get a key pair of their own, for this run only
        local_dir, keys = group.local_actor_keys(
            keys, lambda keys: auth.local_actor_keys(keys, Path(cfg.run.logdir) / ".local-actor-keys")
        )
    count = group.local_actors(cfg.local_actors)
    if count <= 0:
        if zygote is not None:
            zygote.close()  # a rank other than 0: rank 0 starts the actors
        return (lambda listen, publish: None), keys
    options = cfg.actors.options()

    def make_actors(listen: str, publish: str) -> ActorProcesses:
        def argv(i: int, fd: int, parent: int) -> list[str]:
            return actor_argv(
                listen, publish, i, fd, parent, seed=cfg.run.seed, options=options, curve_keys=str(local_dir or "")
            )

        return ActorProcesses.with_options(argv, count, options, zygote)

    return make_actors, keys
