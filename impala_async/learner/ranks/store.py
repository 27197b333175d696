"""The learner ranks' rendezvous store: connecting to it under a token, and checking what is read from it.

The store takes orders from whoever connects to it (any local process can reach a loopback port), so every key lies
under a random token (``impala-async/<restart>/<token>/``): rank 0 draws one (``secrets.token_hex``) and hands it to
the ranks it starts over an inherited pipe, never in their environment (IMPALA_ASYNC_RANK_TOKEN_FD names the pipe's
descriptor). Under torchrun there is no such channel: the operator sets the same IMPALA_ASYNC_RANK_TOKEN for every
rank (else the keys have no token and a warning says so). Every value read from the store is checked before use
(here: the configuration, the addresses, the local actors' key; watch.py: beats and stops): a rank that holds
the token but writes nonsense is refused with one line at startup, and ignored (counted, logged) afterwards.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import struct
from datetime import timedelta

from ...core.address import parse_tcp

log = logging.getLogger("impala_async.learner.ranks")

TOKEN_ENV = "IMPALA_ASYNC_RANK_TOKEN"  # the operator's token, the same for every rank (torchrun: no secret channel)
TOKEN_FD_ENV = "IMPALA_ASYNC_RANK_TOKEN_FD"  # set by rank 0 for the ranks it starts: the pipe their token comes on
_TOKEN = re.compile(r"[A-Za-z0-9_-]{16,128}")  # at least 16 characters: too many to guess through the store
_ADDRESS = re.compile(r"(tcp|ipc)://.{1,1000}")  # printable too: checked_address


def prefix(raw, token: str):
    """The store every key goes through: ``impala-async/<restart>/<token>/`` (no token: the keys anyone can guess)."""
    from torch.distributed import PrefixStore

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"impala-async/{restart}/{token}" if token else f"impala-async/{restart}", raw)


def checked_token(token: str, where: str) -> str:
    """``token`` if it is 16-128 characters of [A-Za-z0-9_-] (it goes into every key; a short one could be guessed);
    else SystemExit naming ``where`` it came from."""
    if not _TOKEN.fullmatch(token):
        raise SystemExit(
            f"impala-async: the learner ranks' token from {where} must be 16-128 characters of A-Z a-z 0-9 _ -"
        )
    return token


def worker_token() -> str:
    """Rank r > 0's token: from the pipe rank 0 passed (IMPALA_ASYNC_RANK_TOKEN_FD; read, then closed), else the
    operator's IMPALA_ASYNC_RANK_TOKEN, else none (torchrun without one). Neither stays in the environment that this
    rank's own children would inherit."""
    fd, operator = os.environ.pop(TOKEN_FD_ENV, ""), os.environ.pop(TOKEN_ENV, "")
    if not fd:
        return checked_token(operator, TOKEN_ENV) if operator else ""
    try:
        with os.fdopen(int(fd), "rb") as pipe:
            got = pipe.read(256)
    except (ValueError, OSError) as e:
        raise SystemExit(f"impala-async: no learner ranks' token on descriptor {fd!r} from rank 0: {e}") from None
    return checked_token(got.decode("ascii", "replace"), f"rank 0's pipe (descriptor {fd})")


def lead_token(hosting: bool) -> str:
    """Rank 0's token: the operator's IMPALA_ASYNC_RANK_TOKEN if set; else a random one where rank 0 hosts the store
    (it hands it to the ranks it starts), none under torchrun (with a warning: the store then takes orders from any
    process that reaches it)."""
    operator = os.environ.pop(TOKEN_ENV, "")  # not for train's local actors to inherit
    if operator:
        return checked_token(operator, TOKEN_ENV)
    if hosting:
        return secrets.token_hex(16)
    log.warning(
        "%s is not set: the learner ranks' store at %s:%s takes orders from any process that reaches it "
        "(set the same random token for every rank: README, Several learner ranks)",
        TOKEN_ENV,
        os.environ.get("MASTER_ADDR"),
        os.environ.get("MASTER_PORT"),
    )
    return ""


def connect(rank: int, world: int, timeout_s: float, token: str):
    """The store of the environment's rendezvous: torchrun's agent store, or rank 0's (rank 0 hosts it); (raw store,
    the store under the token's prefix)."""
    from torch.distributed import TCPStore

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    raw = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return raw, prefix(raw, token)


_SHARED = {"config": dict, "layers": dict, "spec": dict, "env_backend": str, "incarnation": int}


def checked_shared(value: bytes) -> dict | str:
    """Rank 0's shared configuration (what join_lead wrote) if ``value`` is JSON of that shape: an object with
    ``config``, ``layers`` and ``spec`` objects, ``env_backend`` a string, ``incarnation`` an int in [1, 2^63); else
    what is wrong (the configuration itself is checked as any other, by config.from_flat, and the spec by
    TrajectorySpec.from_dict)."""
    try:
        shared = json.loads(value)
    except ValueError:  # UnicodeDecodeError included
        return "not JSON"
    if not isinstance(shared, dict):
        return "not a JSON object"
    for key, kind in _SHARED.items():
        if not isinstance(shared.get(key), kind) or isinstance(shared.get(key), bool):
            return f"{key!r} missing or not of type {kind.__name__}"
    if not 1 <= shared["incarnation"] < 1 << 63:
        return f"incarnation {shared['incarnation']} out of [1, 2^63)"
    return shared


def checked_address(value: bytes) -> str | None:
    """A trajectory address another rank shared: ``tcp://HOST:PORT`` (a valid port) or ``ipc://PATH``, printable,
    at most 1,006 characters; else None. What actors are told to connect to, so nothing else passes."""
    try:
        address = value.decode("ascii")
    except UnicodeDecodeError:
        return None
    if not _ADDRESS.fullmatch(address) or not address.isprintable():
        return None
    try:
        parse_tcp(address)
    except ValueError:
        return None
    return address


def host_store(world: int, timeout_s: float):
    """(listening socket, TCPStore) on a free loopback port: nothing outside this machine reaches the store."""
    from torch.distributed import TCPStore

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4 * world)
    raw = TCPStore(
        "127.0.0.1",
        listener.getsockname()[1],
        world,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
    )
    return listener, raw


def checked_key(value: bytes) -> bool:
    """True for a z85 Curve25519 public key (40 characters that decode)."""
    from zmq.utils import z85

    if not isinstance(value, bytes) or len(value) != 40:
        return False
    try:
        z85.decode(value)
    except (ValueError, KeyError, TypeError, struct.error):
        return False
    return True
