"""Configuration: sections of frozen dataclasses (flags, file keys and config.json entries under one name), the
layers a learner's configuration is put together from, and its resolution. Imports nothing of the package but
``core.address``; no zmq, asyncio or torch."""

from .actors import PER_INVOCATION, ActorOptions, ActorTarget, MetricsHttp
from .evaluation import EvalOptions
from .layers import Layered
from .learner import INDEX, LearnerConfig, LocalActors, from_flat
from .machine import env_metrics_host, env_metrics_port, metrics_address_problem, usable_cpus
from .sections import DEFAULT_ENV_BACKEND, ENV_BACKENDS

__all__ = [
    "INDEX",
    "PER_INVOCATION",
    "ActorOptions",
    "ActorTarget",
    "DEFAULT_ENV_BACKEND",
    "ENV_BACKENDS",
    "EvalOptions",
    "Layered",
    "LearnerConfig",
    "LocalActors",
    "MetricsHttp",
    "env_metrics_host",
    "env_metrics_port",
    "from_flat",
    "metrics_address_problem",
    "usable_cpus",
]
