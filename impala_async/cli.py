"""``impala-async``: train | learner | actor.

    impala-async train --env CartPole-v1                      learner + local actors, one command
    impala-async learner --listen tcp://0.0.0.0:5555          learner only; prints the addresses actors attach to
    impala-async actor --learner tcp://HOST:5555              actors on another machine
    impala-async keygen DIR [--name learner|actor]            CurveZMQ key pair for authenticated actors
    impala-async eval --checkpoint RUN_DIR [--video DIR]      play a checkpoint's policy, report its returns
    impala-async healthcheck                                  exit 0 if /healthz answers 200 (Docker HEALTHCHECK)
"""

from __future__ import annotations

import time

START_MONOTONIC = time.monotonic()  # wall_s in metrics counts from here, before the heavy imports

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from .ops.config import (  # noqa: E402
    ENV_BACKENDS,
    PER_INVOCATION_FIELDS,
    LearnerConfig,
    add_arguments,
    env_metrics_host,
    env_metrics_port,
    from_arguments,
    metrics_address_problem,
)

log = logging.getLogger("impala_async")


def _default_publish(listen: str) -> str:
    if listen.startswith("tcp://"):
        host, _, port = listen[len("tcp://"):].rpartition(":")
        return f"tcp://{host}:{'*' if port == '*' else int(port) + 1}"
    if listen.startswith("ipc://"):
        return listen + ".weights"
    raise ValueError(f"cannot derive a publish address from {listen!r}: give --publish")


def _resolve_device(name: str, flag: str = "--device"):
    import torch
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"impala-async: {flag} {name} asked for, but torch sees no CUDA device")
    return device


def _run_learner(cfg: LearnerConfig, default_listen: str, resumed: dict | None = None, argv=()) -> int:
    from .learner import ranks
    from .ops import auth

    group = ranks.join_worker(cfg)  # a learner rank > 0 (learner/ranks.py) runs rank 0's configuration
    if group is not None:
        cfg = group.cfg
    try:  # before the heavy imports: a refusal to start is immediate
        cfg.listen = cfg.listen or default_listen
        cfg.publish = cfg.publish or _default_publish(cfg.listen)
        cfg.check()
        if cfg.tensorboard:
            from .learner import tboard
            if tboard.missing():
                raise ValueError(tboard.missing())
        auth.refuse_insecure(cfg.listen, cfg.publish, bool(cfg.curve_keys), bool(cfg.insecure))
        keys = auth.load_learner_keys(cfg.curve_keys) if cfg.curve_keys else None
    except (ValueError, OSError) as e:
        raise SystemExit(f"impala-async: {e}") from None

    import gymnasium as gym
    import numpy as np
    import torch
    import uvloop

    from .actors.procs import ActorProcesses, actor_argv
    from .actors.vec import make_vec
    from .core import codecs, wire
    from .core.spec import TrajectorySpec
    from .learner.learn import Learner
    from .learner.server import LearnerServer

    if not cfg.logdir:
        cfg.logdir = f"runs/{cfg.env.replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    group = group or ranks.join_lead(cfg, resumed, list(argv))  # rank 0 of several: starts the others now
    device = _resolve_device(cfg.device)
    if cfg.local_actors > 0 and cfg.actor_device != "cpu":
        _resolve_device(cfg.actor_device, "--actor-device")  # no CUDA device: refused before any actor starts
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    if device.type == "cpu":
        torch.set_num_threads(1)  # the actors need the other cores more than a small network needs threads
    try:  # one environment as the actors build it (actors/vec.py): its spaces, and how it stacks frames
        env = make_vec(cfg.env, cfg.env_kwargs_dict, 1, cfg.env_backend)
    except (TypeError, ValueError) as e:  # an argument the environment (or EnvPool) does not take
        raise SystemExit(f"impala-async: --env {cfg.env} --env-kwargs {cfg.env_kwargs}: {e}") from None
    except gym.error.DependencyNotInstalled as e:
        raise SystemExit(f"impala-async: {e}") from None
    spec = TrajectorySpec.from_spaces(env.single_observation_space, env.single_action_space, cfg.unroll_length,
                                      frame_stack=env.frame_stack if cfg.frame_dedup else 0,
                                      core_state_size=cfg.lstm_size if cfg.use_lstm else 0)
    high = float(np.max(env.single_observation_space.high)) if spec.obs_dtype == "uint8" else 255.0
    if not cfg.input_scale:  # uint8 images to [0, 1]: 1/255 for pixels, 1 for MinAtar's 0/1 planes
        cfg.input_scale = 1.0 / max(1.0, high)
    env.close()
    if cfg.obs_codec == codecs.CODEC_JPEG and codecs.refusal(spec.fields[0], high):
        raise SystemExit(f"impala-async: --env {cfg.env}: {codecs.refusal(spec.fields[0], high)}")
    cfg.resolve_for(spec.trajectory_nbytes)
    if group is not None:  # the process group; rank 0's checkpoint state, on every rank
        device, resumed = group.start(device), group.resumed
    try:
        learner = Learner(cfg, spec, device)
    except ValueError as e:  # a network this observation space cannot take (an LSTM on vectors, images too small)
        raise SystemExit(f"impala-async: {e}") from None
    if resumed is not None:
        if dataclasses.replace(TrajectorySpec.from_dict(resumed["spec"]), frame_stack=0) != \
                dataclasses.replace(spec, frame_stack=0):  # how frames travel may change; the network may not
            raise SystemExit(f"impala-async: the checkpoint's trajectory spec {resumed['spec']} differs from this "
                             f"run's {spec.to_dict()}: resume with the same --env and --unroll-length")
        learner.load_state_dict(resumed["learner"])
        log.info("resumed at %d env steps, policy version %d", learner.env_steps_trained, resumed["policy_version"])
    if group is not None:
        group.distribute(learner)  # gradients averaged over the ranks
    run_info = {"protocol": wire.PROTOCOL_VERSION, "env_id": cfg.env, "env_kwargs": cfg.env_kwargs_dict,
                "spec": spec.to_dict(), "model": learner.model_config.to_dict(),
                "max_trajectories_per_message": cfg.max_trajectories_per_message,
                "max_message_bytes": cfg.max_message_bytes, "obs_codec": cfg.obs_codec,
                "jpeg_quality": cfg.jpeg_quality, "env_backend": env.backend}
    server: LearnerServer | None = None
    actors = None
    if group is not None and group.rank and keys is not None and cfg.local_actors > 0:
        keys = group.share_local_actor_key(keys)  # rank 0 made train's local actors a key: admit it too
    if cfg.local_actors > 0 and (group is None or group.rank == 0):
        extra = ["--send-hwm-messages", str(cfg.actor_send_hwm_messages),
                 "--send-buffer-bytes", str(cfg.actor_send_buffer_bytes), "--device", cfg.actor_device]
        if keys is not None:  # local actors get a key pair of their own, admitted for this run only
            local_dir, keys = auth.local_actor_keys(keys, Path(cfg.logdir) / ".local-actor-keys")
            keys = keys if group is None else group.share_local_actor_key(keys)
            extra += ["--curve-keys", str(local_dir)]
        actors = ActorProcesses(
            lambda i, fd: actor_argv(server.listen_endpoint, server.publish_endpoint, i, fd, seed=cfg.seed,
                                     envs_per_actor=cfg.envs_per_actor, heartbeat_interval_s=cfg.heartbeat_interval_s,
                                     extra=extra),
            cfg.local_actors, max_restarts=cfg.max_actor_restarts, heartbeat_timeout_s=cfg.heartbeat_timeout_s)
    server = LearnerServer(cfg, learner, spec, run_info, cfg.logdir, start_monotonic=START_MONOTONIC, actors=actors,
                           keys=keys, resumed=resumed, ranks=group)
    code = uvloop.run(server.serve())
    if code and server.lead:
        print(f"impala-async: stopped: {server.exit_reason}", file=sys.stderr)
    return code if group is None else group.exit(code)


def _config(args, **forced) -> tuple[LearnerConfig, dict | None]:
    """The run's configuration: from the flags, or with --resume from the newest good checkpoint's, where flags given
    explicitly on this command line win (so a resumed run can, say, raise --total-env-steps)."""
    from .learner import ranks

    if not args.resume or ranks.env_rank() > 0:  # a learner rank > 0 takes rank 0's configuration and checkpoint
        return from_arguments(LearnerConfig, args, **forced), None
    from .learner import checkpoint

    found = checkpoint.load_latest(args.resume, max_bytes=args.max_checkpoint_bytes,
                                   validate=checkpoint.validate_learner_state, quarantine=True)
    if found is None:
        raise SystemExit(f"impala-async: no usable checkpoint in {args.resume} (see the warnings above)")
    state, path = found
    log.info("resuming from %s", path)
    names = {f.name for f in dataclasses.fields(LearnerConfig)}
    values = {k: v for k, v in state["config"].items() if k in names}
    values.update({k: getattr(args, k) for k in args.explicit if k in names})
    values.update({k: getattr(args, k) for k in PER_INVOCATION_FIELDS})  # this process's, never the checkpoint's
    if "listen" in args.explicit and "publish" not in args.explicit:
        values["publish"] = ""  # derived from the new --listen, not the old run's port
    values.update(forced, logdir=args.resume)
    return LearnerConfig(**values), state


def cmd_train(args) -> int:
    cfg, resumed = _config(args)
    return _run_learner(cfg, "tcp://127.0.0.1:*", resumed, args.argv)


def cmd_learner(args) -> int:
    cfg, resumed = _config(args, num_actors=0)
    return _run_learner(cfg, "tcp://127.0.0.1:5555", resumed, args.argv)


def cmd_actor(args) -> int:
    import signal

    from .actors import actor, observe, vec
    from .actors.procs import ActorProcesses, actor_argv

    # A supervised child never serves /healthz (its supervisor does; actor_argv also gives it --metrics-port 0).
    serve_port = 0 if args.parent_pid else args.metrics_port
    try:  # refusals come before any process starts, as one line
        weights = args.weights or actor.weights_address(args.learner)
        if args.env_backend == "envpool" and not vec.envpool_installed():
            raise ValueError(vec.ENVPOOL_MISSING)
        if args.device != "cpu":
            _resolve_device(args.device)
        if args.curve_keys:
            from .ops import auth
            auth.load_actor_keys(args.curve_keys)
        problem = metrics_address_problem(serve_port, args.metrics_host)
        if problem:
            raise ValueError(problem)
    except (ValueError, OSError) as e:
        raise SystemExit(f"impala-async: {e}") from None
    if args.num_actors == 1 and not serve_port:  # with a metrics port, even one actor runs under the supervisor
        return actor.run(actor.ActorConfig(
            learner=args.learner, weights=weights, index=args.index, seed=args.seed,
            envs_per_actor=args.envs_per_actor, codec=args.codec, parent_pid=args.parent_pid,
            max_wait_for_weights_s=args.max_wait_for_weights_s, heartbeat_fd=args.heartbeat_fd,
            heartbeat_interval_s=args.heartbeat_interval_s, curve_keys=args.curve_keys,
            send_hwm_messages=args.send_hwm_messages, send_buffer_bytes=args.send_buffer_bytes,
            connection_timeout_s=args.connection_timeout_s, env_backend=args.env_backend, device=args.device))
    extra = ["--codec", args.codec, "--env-backend", args.env_backend, "--device", args.device,
             "--send-hwm-messages", str(args.send_hwm_messages), "--send-buffer-bytes",
             str(args.send_buffer_bytes), "--connection-timeout-s", str(args.connection_timeout_s)] + (
        ["--curve-keys", args.curve_keys] if args.curve_keys else [])
    procs = ActorProcesses(
        lambda i, fd: actor_argv(args.learner, weights, args.index + i, fd, seed=args.seed,
                                 envs_per_actor=args.envs_per_actor, heartbeat_interval_s=args.heartbeat_interval_s,
                                 extra=extra),
        args.num_actors, heartbeat_timeout_s=args.heartbeat_timeout_s)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    state, http = observe.SupervisorState(procs), None
    if serve_port:  # before the actors start: a port that cannot be bound is refused at once
        try:
            http = observe.serve(state, args.metrics_host, serve_port, max_connections=args.max_metrics_connections,
                                 request_timeout_s=args.metrics_request_timeout_s,
                                 max_request_bytes=args.max_metrics_request_bytes)
        except OSError as e:
            raise SystemExit(f"impala-async: cannot serve /healthz on {args.metrics_host}:{serve_port} "
                             f"(--metrics-host, --metrics-port): {e}") from None
    procs.start()
    print(f"impala-async: {args.num_actors} actors -> {args.learner} (weights from {weights})", flush=True)
    while not stopping:
        procs.check()
        time.sleep(0.2)
    state.stopping = True  # /healthz: 503 from here on
    procs.stop(5.0)
    if http is not None:
        http.close()
    return 0


def cmd_keygen(args) -> int:
    from .ops import auth

    try:
        public, secret = auth.keygen(args.directory, args.name)
    except (FileExistsError, ValueError) as e:
        raise SystemExit(f"impala-async: {e}") from None
    print(f"wrote {public} (public: share it) and {secret} (secret, mode 0600: keep it here)")
    return 0


def cmd_healthcheck(args) -> int:
    """GET /healthz of the learner or actor supervisor on this machine: exit 0 on 200, 1 otherwise."""
    from .ops import httpd

    if not 1 <= args.metrics_port <= 65535:
        print(f"impala-async healthcheck: no metrics port (got {args.metrics_port}): give --metrics-port or set "
              f"IMPALA_ASYNC_METRICS_PORT", file=sys.stderr)
        return 1
    try:
        status, body = httpd.probe(args.metrics_host, args.metrics_port, args.path, args.timeout_s)
    except OSError as e:
        print(f"impala-async healthcheck: {args.metrics_host}:{args.metrics_port}: {e}", file=sys.stderr)
        return 1
    print(f"{status} {body.strip()}")
    return 0 if status == 200 else 1


def _add_metrics_flags(p: argparse.ArgumentParser) -> None:
    """--metrics-port and --metrics-host, defaulting to the environment as the learner's do (ops/config.py)."""
    p.add_argument("--metrics-port", type=int, default=env_metrics_port(), help=(
        "serve /healthz and /metrics on this TCP port (0: off; default: $IMPALA_ASYNC_METRICS_PORT, else 0)"))
    p.add_argument("--metrics-host", default=env_metrics_host(), help=(
        "address of the metrics port (default: $IMPALA_ASYNC_METRICS_HOST, else 127.0.0.1)"))


def cmd_eval(args) -> int:
    from .learner import evaluate

    opts = evaluate.EvalOptions(
        checkpoint=args.checkpoint, episodes=args.episodes, greedy=args.greedy, seed=args.seed,
        max_episode_steps=args.max_episode_steps, video=args.video, video_episodes=args.video_episodes,
        video_max_frames=args.video_max_frames, fps=args.fps, max_checkpoint_bytes=args.max_checkpoint_bytes)
    try:
        return evaluate.main(opts, as_json=args.json)
    except evaluate.EvalError as e:
        raise SystemExit(f"impala-async eval: {e}") from None


def _add_eval(sub) -> None:
    ev = sub.add_parser("eval", help="play a checkpoint's policy and report its returns", description=(
        "Load a learner checkpoint, play --episodes episodes in the run's environment (built as actors build it) "
        "and print the mean and standard deviation of the return and the episode length; --video DIR films them."))
    ev.add_argument("--checkpoint", required=True, metavar="PATH",
                    help="a checkpoint file, or a run directory (its newest good checkpoint)")
    ev.add_argument("--episodes", type=int, default=10, help="episodes to play (default: 10)")
    ev.add_argument("--greedy", action="store_true", help="take the most likely action instead of sampling")
    ev.add_argument("--seed", type=int, default=0, help="seeds the first reset and the sampling (default: 0)")
    ev.add_argument("--max-episode-steps", type=int, default=100_000,
                    help="cut an episode after this many steps, reported as cut (default: 100000)")
    ev.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    ev.add_argument("--video", default="", metavar="DIR", help=(
        "write a video per episode into DIR: MP4, or GIF without ffmpeg (pip install 'impala-async[video]')"))
    ev.add_argument("--video-episodes", type=int, default=0, metavar="K",
                    help="film only the first K episodes (default: 0, every one)")
    ev.add_argument("--video-max-frames", type=int, default=10_000,
                    help="frames per video at most; a GIF holds them in memory (default: 10000)")
    ev.add_argument("--fps", type=int, default=30, help="video frame rate (default: 30)")
    ev.add_argument("--max-checkpoint-bytes", type=int, default=4 << 30,
                    help="refuse a checkpoint larger than this (default: 4 GiB)")
    ev.set_defaults(func=cmd_eval)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="impala-async", description="IMPALA (V-trace actor-learner) over ZeroMQ.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser("train", help="run a learner and local actors", description=(
        "Train with a learner and --num-actors local actor processes. External actors may attach as well."))
    add_arguments(train, LearnerConfig)
    train.add_argument("--resume", metavar="LOGDIR", default="", help=(
        "continue the run in LOGDIR from its newest good checkpoint: same configuration (flags given here win), "
        "counters intact, metrics appended"))
    train.set_defaults(func=cmd_train)
    learner = sub.add_parser("learner", help="run only the learner; actors attach by address", description=(
        "Run the learner alone. Actors on this or other machines attach with "
        "'impala-async actor --learner ADDRESS'; the addresses are printed at start."))
    add_arguments(learner, LearnerConfig, skip={"num_actors", "envs_per_actor"})
    learner.add_argument("--resume", metavar="LOGDIR", default="", help=(
        "continue from LOGDIR's newest good checkpoint (a restarted learner; attached actors carry on)"))
    learner.set_defaults(func=cmd_learner)
    act = sub.add_parser("actor", help="run actors that attach to a learner", description=(
        "Run actors against a running learner. The environment, unroll length and network come from the "
        "learner with its weights."))
    act.add_argument("--learner", required=True, help="the learner's trajectory address (its --listen)")
    act.add_argument("--weights", default="", help="the learner's weights address (default: learner port + 1)")
    act.add_argument("--num-actors", type=int, default=1, help="actor processes to run (default: 1)")
    act.add_argument("--envs-per-actor", type=int, default=16, help="environments per actor (default: 16)")
    act.add_argument("--seed", type=int, default=0, help="base seed (default: 0)")
    act.add_argument("--index", type=int, default=0, help="index of the first actor, for seeding (default: 0)")
    act.add_argument("--send-hwm-messages", type=int, default=4,
                     help="ZMQ_SNDHWM: messages queued before a send waits (default: 4)")
    act.add_argument("--send-buffer-bytes", type=int, default=0,
                     help="ZMQ_SNDBUF, the kernel's send buffer (default: 0, the system's)")
    act.add_argument("--connection-timeout-s", type=float, default=6.0, help=(
        "drop and remake a connection to the learner that answers no ZeroMQ heartbeat for this long; connection "
        "attempts give up after half of it (0: TCP's own timeouts, minutes after a long outage) (default: 6)"))
    act.add_argument("--codec", choices=("lz4", "none"), default="lz4", help=(
        "array compression (default: lz4); images go as JPEG instead when the learner asks for it (--obs-codec jpeg)"))
    act.add_argument("--env-backend", choices=("", *ENV_BACKENDS), default="", metavar="{auto,gymnasium,envpool}",
                     help=("how to step Atari ids: gymnasium, envpool (pip install 'impala-async[envpool]') or auto "
                           "(envpool where installed); other ids always use gymnasium (default: the learner's "
                           "run.env_backend, else gymnasium)"))
    act.add_argument("--device", default="cpu", help="where the policy's forward pass runs: cpu or cuda[:N] "
                                                     "(default: cpu)")
    act.add_argument("--curve-keys", default="", help="directory with actor.key_secret and learner.key: connect with "
                                                      "CurveZMQ (see README, Security)")
    act.add_argument("--max-wait-for-weights-s", type=float, default=600.0,
                     help="give up if no weights arrive within this long (default: 600)")
    act.add_argument("--heartbeat-interval-s", type=float, default=1.0,
                     help="actors report that they are alive this often (default: 1)")
    act.add_argument("--heartbeat-timeout-s", type=float, default=10.0,
                     help="with --num-actors > 1 or a metrics port (the supervisor): replace an actor silent "
                          "for this long (default: 10)")
    _add_metrics_flags(act)
    defaults = {f.name: f.default for f in dataclasses.fields(LearnerConfig)}
    act.add_argument("--max-metrics-connections", type=int, default=defaults["max_metrics_connections"],
                     help="metrics HTTP connections answered at once (default: %(default)s)")
    act.add_argument("--metrics-request-timeout-s", type=float, default=defaults["metrics_request_timeout_s"],
                     help="a metrics HTTP request must be answered within this long (default: %(default)s)")
    act.add_argument("--max-metrics-request-bytes", type=int, default=defaults["max_metrics_request_bytes"],
                     help="a longer metrics HTTP request head is refused (default: %(default)s)")
    act.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    act.add_argument("--heartbeat-fd", type=int, default=-1, help=argparse.SUPPRESS)
    act.set_defaults(func=cmd_actor)
    keygen = sub.add_parser("keygen", help="write a CurveZMQ key pair", description=(
        "Write DIR/NAME.key (public) and DIR/NAME.key_secret (mode 0600). The learner needs its pair named "
        "'learner' and the actors' public keys in DIR/allowed/; an actor needs its pair named 'actor' and the "
        "learner's learner.key. See README, Security."))
    keygen.add_argument("directory", help="where to write the key files (created with mode 0700)")
    keygen.add_argument("--name", default="learner", help="file name stem: learner or actor (default: learner)")
    keygen.set_defaults(func=cmd_keygen)
    _add_eval(sub)
    hc = sub.add_parser("healthcheck", help="exit 0 if the local learner or actor supervisor is healthy", description=(
        "GET /healthz from the metrics port of a learner or actor supervisor on this machine (the Docker "
        "HEALTHCHECK): print the answer, exit 0 on 200 and 1 on anything else or no answer."))
    _add_metrics_flags(hc)
    hc.add_argument("--path", default="/healthz", help="the path to GET (default: /healthz)")
    hc.add_argument("--timeout-s", type=float, default=5.0, help="give up after this long (default: 5)")
    hc.set_defaults(func=cmd_healthcheck)
    return p


def _explicit_flags(parser: argparse.ArgumentParser, command: str, argv: list[str]) -> set[str]:
    """Destinations of the options actually typed on the command line (not left at their defaults)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    given = set()
    for action in sub._actions:
        for opt in action.option_strings:
            if any(tok == opt or tok.startswith(opt + "=") for tok in argv):
                given.add(action.dest)
    return given


def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.explicit = _explicit_flags(parser, args.command, argv)
    args.argv = argv  # learner ranks > 0 run the same command line (learner/ranks.py)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
