"""The learner: the asyncio server, its ingest path, guards, weights publisher, training thread, the IMPALA update,
metrics and checkpoints. Imports ``core``, ``config``, ``ops`` and ``actors`` (the local actor processes)."""
