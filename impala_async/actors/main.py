"""``impala-async actor``: one actor in this process, or several under a supervisor (restarts, heartbeats, /healthz).

Refusals (a bad address, EnvPool or CUDA asked for and missing, unsafe keys, an unusable metrics port) come before
any process starts, as one line.
"""

from __future__ import annotations

import signal
import time

from ..config import ActorOptions, ActorTarget, MetricsHttp
from ..config.machine import metrics_address_problem


def refuse(target: ActorTarget, options: ActorOptions, serve_port: int, metrics_host: str) -> str:
    """The weights address to subscribe to; ValueError (or OSError) for what must not start."""
    from . import actor, vec

    target.check()
    options.check()
    weights = target.weights or actor.weights_address(target.learner)
    if target.env_backend == "envpool" and not vec.envpool_installed():
        raise ValueError(vec.ENVPOOL_MISSING)
    if options.device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {options.device} asked for, but torch sees no CUDA device")
    if target.curve_keys:
        from ..ops import auth

        auth.load_actor_keys(target.curve_keys)
    problem = metrics_address_problem(serve_port, metrics_host)
    if problem:
        raise ValueError(problem)
    return weights


def run(
    target: ActorTarget, options: ActorOptions, metrics: MetricsHttp, *, parent_pid: int = 0, heartbeat_fd: int = -1
) -> int:
    """Act until SIGINT/SIGTERM; the exit code (README, Exit codes)."""
    from . import actor

    serve_port = 0 if parent_pid else metrics.metrics_port  # a supervised child never serves /healthz
    try:
        weights = refuse(target, options, serve_port, metrics.metrics_host)
    except (ValueError, OSError) as e:
        raise SystemExit(f"impala-async: {e}") from None
    if target.num_actors == 1 and not serve_port:  # with a metrics port, even one actor runs under the supervisor
        return actor.run(
            actor.ActorConfig(
                learner=target.learner,
                weights=weights,
                options=options,
                index=target.index,
                seed=target.seed,
                curve_keys=target.curve_keys,
                env_backend=target.env_backend,
                parent_pid=parent_pid,
                heartbeat_fd=heartbeat_fd,
            )
        )
    return supervise(target, options, metrics, weights, serve_port)


def supervise(target: ActorTarget, options: ActorOptions, metrics: MetricsHttp, weights: str, serve_port: int) -> int:
    """``target.num_actors`` actor processes, restarted as ``options`` say, /healthz on ``serve_port`` (0: off)."""
    from .zygote import Zygote

    zygote = Zygote.fork() if options.forks() else None  # first: this process runs no thread yet
    try:
        return _supervise(target, options, metrics, weights, serve_port, zygote)
    finally:
        if zygote is not None:
            zygote.close()


def _supervise(target: ActorTarget, options: ActorOptions, metrics: MetricsHttp, weights: str, serve_port: int, zygote):
    from . import observe
    from .procs import ActorProcesses, actor_argv

    procs = ActorProcesses.with_options(
        lambda i, fd, parent: actor_argv(
            target.learner,
            weights,
            target.index + i,
            fd,
            parent,
            seed=target.seed,
            options=options,
            curve_keys=target.curve_keys,
            env_backend=target.env_backend,
        ),
        target.num_actors,
        options,
        zygote,
    )
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    state, http = observe.SupervisorState(procs), None
    if serve_port:  # before the actors start: a port that cannot be bound is refused at once
        try:
            http = observe.serve(state, metrics.metrics_host, serve_port, **observe.server_options(metrics))
        except OSError as e:
            raise SystemExit(
                f"impala-async: cannot serve /healthz on {metrics.metrics_host}:{serve_port} "
                f"(--metrics-host, --metrics-port): {e}"
            ) from None
    procs.start()
    print(f"impala-async: {target.num_actors} actors -> {target.learner} (weights from {weights})", flush=True)
    while not stopping:
        procs.check()
        time.sleep(0.2)
    state.stopping = True  # /healthz: 503 from here on
    procs.stop(5.0)
    if http is not None:
        http.close()
    return 0
