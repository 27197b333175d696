"""The learner's transport: trajectories in (``intake.py`` the trajectory socket's receive loop and its limits,
``ingest.py`` a message decoded into the ring), weights out (``publisher.py``), the guard over both sockets'
connections (``guard.py``: connections, unread bytes, subscriptions, what subscribers leave untaken) and flow control
(``pacing.py``: the pace sent to actors). docs/protocol.md is the wire they speak."""
