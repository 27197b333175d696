"""impala_async: IMPALA (Espeholt et al. 2018) as an asyncio learner server with ZeroMQ-attached actors."""

__version__ = "0.1.0"
