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
import logging  # noqa: E402
import sys  # noqa: E402

from .config import (  # noqa: E402
    INDEX,
    ActorOptions,
    ActorTarget,
    EvalOptions,
    MetricsHttp,
    env_metrics_host,
    env_metrics_port,
)
from .config import fields as config_fields  # noqa: E402
from .ops import exitcodes  # noqa: E402

log = logging.getLogger("impala_async")
LAYERS_HELP = """

Each value comes from the highest of these layers: the built-in defaults, a preset for the environment's family
(--preset), the checkpoint's configuration (--resume), --config FILE, the flags typed. The resolved configuration, with
the layer of each value, is written to LOGDIR/config.json and its differences from the defaults are printed at start.
"""


def learner_sections():
    from .config.learner import section_classes

    return section_classes()


# train and learner: --listen defaults (a free loopback port for train, the documented 5555 for learner), and what
# each command fixes whatever the flags say
COMMANDS = {"train": ("tcp://127.0.0.1:*", {}), "learner": ("tcp://127.0.0.1:5555", {"num_actors": 0})}
LEARNER_SKIPS = {"train": (), "learner": ("num_actors", "envs_per_actor")}  # flags the learner command has not


def load_learner_config(args):
    """train and learner: (the configuration's layers, the state of the checkpoint a --resume continues or None);
    SystemExit with one line for a wrong file or value, or a resume without a usable checkpoint."""
    from .learner import main as learner_main

    flags = {k: v for k, v in vars(args).items() if k in INDEX}  # exactly the flags typed (their default: SUPPRESS)

    def load_checkpoint(directory: str, max_bytes: int):
        from .learner.checkpoint import resume  # torch: only for a resume

        return resume.load_newest(directory, max_bytes)  # checked whole; those that fail are set aside

    try:
        return learner_main.configure(
            flags,
            file=args.config,
            resume=args.resume,
            command=COMMANDS[args.command][1],
            load_checkpoint=load_checkpoint,
        )
    except ValueError as e:
        raise SystemExit(f"impala-async: {e}") from None


def cmd_learner(args) -> int:
    from .learner import main as learner_main

    layered, resumed = load_learner_config(args)
    return learner_main.run(
        layered,
        resumed,
        command=args.command,
        default_listen=COMMANDS[args.command][0],
        argv=args.argv,
        start_monotonic=START_MONOTONIC,
    )


def _section(cls, args, learner: bool = False):
    """A section from the defaults and the flags typed (a refusal, one line, if a value is wrong)."""
    values = {
        f.name: getattr(args, config_fields.flag_of(f, learner))
        for f in config_fields.fields_of(cls)
        if hasattr(args, config_fields.flag_of(f, learner))
    }
    return cls(**values)


def cmd_actor(args) -> int:
    from .actors import main as actor_main

    return actor_main.run(
        _section(ActorTarget, args),
        _section(ActorOptions, args),
        _section(MetricsHttp, args),
        parent_pid=args.parent_pid,
        heartbeat_fd=args.heartbeat_fd,
    )


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
        print(
            f"impala-async healthcheck: no metrics port (got {args.metrics_port}): give --metrics-port or set "
            f"IMPALA_ASYNC_METRICS_PORT",
            file=sys.stderr,
        )
        return 1
    try:
        status, body = httpd.probe(args.metrics_host, args.metrics_port, args.path, args.timeout_s)
    except OSError as e:
        print(f"impala-async healthcheck: {args.metrics_host}:{args.metrics_port}: {e}", file=sys.stderr)
        return 1
    print(f"{status} {body.strip()}")
    return 0 if status == 200 else 1


def _add_metrics_flags(p: argparse.ArgumentParser) -> None:
    """--metrics-port and --metrics-host, defaulting to the environment as the learner's do (config/machine.py)."""
    p.add_argument(
        "--metrics-port",
        type=int,
        default=env_metrics_port(),
        help=("serve /healthz and /metrics on this TCP port (0: off; default: $IMPALA_ASYNC_METRICS_PORT, else 0)"),
    )
    p.add_argument(
        "--metrics-host",
        default=env_metrics_host(),
        help=("address of the metrics port (default: $IMPALA_ASYNC_METRICS_HOST, else 127.0.0.1)"),
    )


def cmd_eval(args) -> int:
    from . import evaluate

    try:
        return evaluate.main(_section(EvalOptions, args), as_json=args.json)
    except evaluate.EvalError as e:
        raise SystemExit(f"impala-async eval: {e}") from None


def _add_eval(sub) -> None:
    ev = sub.add_parser(
        "eval",
        help="play a checkpoint's policy and report its returns",
        description=(
            "Load a learner checkpoint, play --episodes episodes in the run's environment (built as actors build it) "
            "and print the mean and standard deviation of the return and the episode length; --video DIR films them."
        ),
    )
    config_fields.add_arguments(ev, EvalOptions, learner=False, required=("checkpoint",))
    ev.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    ev.set_defaults(func=cmd_eval)


LEARNER_COMMANDS = (
    (
        "train",
        "run a learner and local actors",
        "Train with a learner and --num-actors local actor processes. External actors may attach as well.",
    ),
    (
        "learner",
        "run only the learner; actors attach by address",
        "Run the learner alone. Actors on this or other machines attach with 'impala-async actor --learner ADDRESS'; "
        "the addresses are printed at start.",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="impala-async",
        description="IMPALA (V-trace actor-learner) over ZeroMQ.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__ + "\n" + exitcodes.table_text(),
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text, description in LEARNER_COMMANDS:
        _add_learner_command(sub, name, text, description)
    _add_actor(sub)
    _add_keygen(sub)
    _add_eval(sub)
    _add_healthcheck(sub)
    return p


def _add_learner_command(sub, name: str, text: str, description: str) -> None:
    """train or learner: --config, --resume, and every section's flags (config/sections.py), grouped."""
    cmd = sub.add_parser(
        name,
        help=text,
        description=description + LAYERS_HELP,
        usage=f"impala-async {name} [-h] [--config FILE] [--resume LOGDIR] [--FLAG VALUE ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=exitcodes.table_text(),
    )
    cmd.add_argument(
        "--config",
        metavar="FILE",
        default="",
        help=(
            "a TOML or YAML file of flag names and values (tables named after the sections below allowed), or a run's "
            "LOGDIR/config.json to run its configuration again; flags typed here win"
        ),
    )
    cmd.add_argument(
        "--resume",
        metavar="LOGDIR",
        default="",
        help=(
            "continue the run in LOGDIR from its newest good checkpoint: same configuration (--config and flags given "
            "here win), counters intact, metrics appended (a restarted learner: attached actors carry on)"
        ),
    )
    for _, cls in learner_sections():
        config_fields.add_arguments(cmd, cls, learner=True, skip=LEARNER_SKIPS[name])
    cmd.set_defaults(func=cmd_learner)


def _add_actor(sub) -> None:
    act = sub.add_parser(
        "actor",
        help="run actors that attach to a learner",
        description=(
            "Run actors against a running learner. The environment, unroll length and network come from the learner "
            "with its weights."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=exitcodes.table_text(),
    )
    for cls in (ActorTarget, ActorOptions, MetricsHttp):
        config_fields.add_arguments(act, cls, learner=False, required=("learner",))
    act.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    act.add_argument("--heartbeat-fd", type=int, default=-1, help=argparse.SUPPRESS)
    act.set_defaults(func=cmd_actor)


def _add_keygen(sub) -> None:
    keygen = sub.add_parser(
        "keygen",
        help="write a CurveZMQ key pair",
        description=(
            "Write DIR/NAME.key (public) and DIR/NAME.key_secret (mode 0600). The learner needs its pair named "
            "'learner' and the actors' public keys in DIR/allowed/; an actor needs its pair named 'actor' and the "
            "learner's learner.key. See README, Security."
        ),
    )
    keygen.add_argument("directory", help="where to write the key files (created with mode 0700)")
    keygen.add_argument("--name", default="learner", help="file name stem: learner or actor (default: learner)")
    keygen.set_defaults(func=cmd_keygen)


def _add_healthcheck(sub) -> None:
    hc = sub.add_parser(
        "healthcheck",
        help="exit 0 if the local learner or actor supervisor is healthy",
        description=(
            "GET /healthz from the metrics port of a learner or actor supervisor on this machine (the Docker "
            "HEALTHCHECK): print the answer, exit 0 on 200 and 1 on anything else or no answer."
        ),
    )
    _add_metrics_flags(hc)
    hc.add_argument("--path", default="/healthz", help="the path to GET (default: /healthz)")
    hc.add_argument("--timeout-s", type=float, default=5.0, help="give up after this long (default: 5)")
    hc.set_defaults(func=cmd_healthcheck)


def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # learner ranks > 0 run the same command line (learner/ranks/)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return args.func(args)
    except KeyboardInterrupt:  # before the command's own signal handlers (its startup): no traceback
        print("impala-async: interrupted", file=sys.stderr)
        return exitcodes.FORCED


if __name__ == "__main__":
    sys.exit(main())
