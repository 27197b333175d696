"""CurveZMQ + ZAP authentication (impala_async.ops.auth) with real sockets on tcp://127.0.0.1.

Rejections are checked twice: the server's socket monitor must report the failed handshake (a condition waited on with
a timeout), and then polling the server for ``NOTHING_ARRIVES_S`` must get nothing.
"""

import contextlib
import os
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq
from procutil import cli, free_port_pair
from zmq.auth import load_certificate
from zmq.utils.monitor import parse_monitor_message

from impala_async.ops import auth

NOTHING_ARRIVES_S = 1.5  # how long a rejected client is given to deliver something (it must not)
EVENT_TIMEOUT_S = 5.0  # upper bound on waiting for a handshake event or an admitted message
PUBLISH_INTERVAL_S = 0.05
ACTOR_NAME = "gpu-box-3"
OTHER_UID = 65534  # neither root nor (when run as root) the test's own uid: "nobody" on most systems
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid (chown) needs root")


@dataclass
class KeyDirs:
    learner: Path  # learner.key_secret, learner.key, allowed/gpu-box-3.key
    actor: Path  # admitted actor: actor.key_secret, actor.key, learner.key
    stranger: Path  # same layout as actor, but its key is not in learner/allowed


def _make_actor_dir(directory: Path, learner_public: Path) -> Path:
    """An actor key directory: its own pair plus a copy of the learner's public key; returns its public key file."""
    public, _ = auth.keygen(directory, "actor")
    shutil.copy(learner_public, directory / "learner.key")
    return public


@pytest.fixture
def key_dirs(tmp_path) -> KeyDirs:
    dirs = KeyDirs(tmp_path / "learner", tmp_path / "actor", tmp_path / "stranger")
    learner_public, _ = auth.keygen(dirs.learner, "learner")
    (dirs.learner / "allowed").mkdir(mode=0o700)  # whatever the umask: the loaders refuse a group-writable one
    shutil.copy(_make_actor_dir(dirs.actor, learner_public), dirs.learner / "allowed" / f"{ACTOR_NAME}.key")
    _make_actor_dir(dirs.stranger, learner_public)
    return dirs


def _bind_local(socket: zmq.Socket) -> str:
    socket.bind("tcp://127.0.0.1:*")
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)


def _client(context: zmq.Context, kind: int, endpoint: str, key_dir: Path | None) -> zmq.Socket:
    """A connected client socket; CURVE with the keys in ``key_dir``, or plain (NULL) if it is None."""
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    if key_dir is not None:
        auth.make_curve_client(socket, auth.load_actor_keys(key_dir))
    if kind == zmq.SUB:
        socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    return socket


def _wait_for_event(monitor: zmq.Socket, wanted: set[int], timeout_s: float = EVENT_TIMEOUT_S) -> int:
    """The first monitor event in ``wanted`` within ``timeout_s`` (synchronous monitor socket)."""
    deadline = time.monotonic() + timeout_s
    while (remaining_s := deadline - time.monotonic()) > 0:
        if monitor.poll(remaining_s * 1000):
            event = parse_monitor_message(monitor.recv_multipart())["event"]
            if event in wanted:
                return event
    raise AssertionError(f"none of the monitor events {_names(wanted)} within {timeout_s} s")


@contextlib.contextmanager
def _curve_server(context: zmq.Context, key_dirs, kind: int):
    """A CURVE server socket of ``kind`` behind the learner's thread authenticator, bound on loopback and monitored:
    yields (socket, monitor, endpoint) and closes all three, then the authenticator."""
    keys = auth.load_learner_keys(key_dirs.learner)
    authenticator = auth.start_thread_authenticator(context, keys)
    try:
        server = context.socket(kind)
        auth.make_curve_server(server, keys)
        monitor = server.get_monitor_socket()
        try:
            yield server, monitor, _bind_local(server)
        finally:
            server.disable_monitor()
            monitor.close(0)
            server.close(0)
    finally:
        auth.stop_authenticator(authenticator)


def _names(events: set[int]) -> list[str]:
    return sorted(zmq.Event(e).name for e in events)


# ------------------------------------------------------------------------------------------------------ key files
def test_keygen_writes_a_public_file_and_a_private_secret_file(tmp_path):
    directory = tmp_path / "new" / "keys"
    public_path, secret_path = auth.keygen(directory, "learner")
    assert (public_path, secret_path) == (directory / "learner.key", directory / "learner.key_secret")
    assert stat.S_IMODE(os.stat(secret_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(directory).st_mode) & 0o077 == 0
    public, no_secret = load_certificate(public_path)
    same_public, secret = load_certificate(secret_path)
    assert no_secret is None and same_public == public
    assert len(public) == len(secret) == 40 and zmq.curve_public(secret) == public


def test_keygen_refuses_to_overwrite(tmp_path):
    public_path, secret_path = auth.keygen(tmp_path, "actor")
    before = secret_path.read_bytes()
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        auth.keygen(tmp_path, "actor")
    public_path.unlink()  # half a pair left: still refuse, and keep the secret
    with pytest.raises(FileExistsError, match="actor.key_secret exists"):
        auth.keygen(tmp_path, "actor")
    assert secret_path.read_bytes() == before and not public_path.exists()


def test_check_secret_file_rejects_group_readable_and_missing_files(key_dirs):
    secret_path = key_dirs.learner / "learner.key_secret"
    auth.check_secret_file(secret_path)
    secret_path.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        auth.check_secret_file(secret_path)
    with pytest.raises(PermissionError, match="chmod 600"):
        auth.load_learner_keys(key_dirs.learner)
    with pytest.raises(FileNotFoundError, match="not found"):
        auth.check_secret_file(key_dirs.learner / "missing.key_secret")


def test_load_learner_keys_names_each_allowed_key(key_dirs):
    keys = auth.load_learner_keys(key_dirs.learner)
    actor = auth.load_actor_keys(key_dirs.actor)
    assert keys.allowed == {actor.public: ACTOR_NAME}
    assert actor.server_public == keys.public
    assert keys.secret not in repr(keys).encode() and actor.secret not in repr(actor).encode()


def test_load_learner_keys_refuses_missing_or_empty_allowed(key_dirs):
    allowed = key_dirs.learner / "allowed"
    (allowed / f"{ACTOR_NAME}.key").unlink()
    with pytest.raises(ValueError, match="holds no"):
        auth.load_learner_keys(key_dirs.learner)
    allowed.rmdir()
    with pytest.raises(ValueError, match="does not exist"):
        auth.load_learner_keys(key_dirs.learner)


def test_load_learner_keys_refuses_a_secret_in_allowed(key_dirs):
    shutil.copy(key_dirs.stranger / "actor.key_secret", key_dirs.learner / "allowed" / "oops.key")
    with pytest.raises(ValueError, match="contains a secret key"):
        auth.load_learner_keys(key_dirs.learner)


# ------------------------------------------------------------------------------- owners, modes and links (StrictModes)
def _load_both(key_dirs) -> None:
    keys = auth.load_learner_keys(key_dirs.learner)
    assert keys.allowed == {auth.load_actor_keys(key_dirs.actor).public: ACTOR_NAME}


def _target(key_dirs, name: str) -> tuple[Path, object]:
    """(a path in the fixture's layout, the loader that reads it) by short name."""
    return {
        "learner dir": (key_dirs.learner, auth.load_learner_keys),
        "allowed dir": (key_dirs.learner / "allowed", auth.load_learner_keys),
        "actor dir": (key_dirs.actor, auth.load_actor_keys),
        "learner secret": (key_dirs.learner / "learner.key_secret", auth.load_learner_keys),
        "actor secret": (key_dirs.actor / "actor.key_secret", auth.load_actor_keys),
        "allowed key": (key_dirs.learner / "allowed" / f"{ACTOR_NAME}.key", auth.load_learner_keys),
        "actor's learner.key": (key_dirs.actor / "learner.key", auth.load_actor_keys),
    }[name]


def _refusal(load, directory: Path, *phrases: str) -> str:
    """The message of the PermissionError ``load(directory)`` raises; it holds each phrase and is one line."""
    with pytest.raises(PermissionError) as refused:
        load(directory)
    message = str(refused.value)
    assert "\n" not in message
    for phrase in phrases:
        assert phrase in message, message
    return message


@pytest.mark.parametrize(
    ("dir_mode", "allowed_mode", "public_mode", "secret_mode"),
    [(0o700, 0o700, 0o644, 0o600), (0o755, 0o755, 0o444, 0o400), (0o750, 0o711, 0o600, 0o600)],
)
def test_a_correct_layout_loads(key_dirs, tmp_path, dir_mode, allowed_mode, public_mode, secret_mode):
    for directory in (key_dirs.learner, key_dirs.actor):
        directory.chmod(dir_mode)
    (key_dirs.learner / "allowed").chmod(allowed_mode)
    for path in (key_dirs.learner / "allowed" / f"{ACTOR_NAME}.key", key_dirs.actor / "learner.key"):
        path.chmod(public_mode)
    for path in (key_dirs.learner / "learner.key_secret", key_dirs.actor / "actor.key_secret"):
        path.chmod(secret_mode)
    _load_both(key_dirs)
    (tmp_path / "linked").symlink_to(key_dirs.learner)  # a link to a key directory is followed, and the target checked
    assert auth.load_learner_keys(tmp_path / "linked").public == auth.load_learner_keys(key_dirs.learner).public


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o720], ids=oct)
@pytest.mark.parametrize("name", ["learner dir", "allowed dir", "actor dir"])
def test_refuses_a_key_directory_others_can_write(key_dirs, name, mode):
    path, load = _target(key_dirs, name)
    path.chmod(mode)
    _refusal(
        load,
        key_dirs.learner if load is auth.load_learner_keys else key_dirs.actor,
        f"{path} is writable by group or others",
        f"mode {mode:04o}",
        f"chmod go-w {path}",
    )
    path.chmod(0o700)
    _load_both(key_dirs)


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666], ids=oct)
@pytest.mark.parametrize("name", ["allowed key", "actor's learner.key"])
def test_refuses_a_public_key_others_can_write(key_dirs, name, mode):
    path, load = _target(key_dirs, name)
    path.chmod(mode)
    _refusal(
        load,
        path.parent.parent if name == "allowed key" else path.parent,
        f"public key file {path} is writable by group or others",
        f"mode {mode:04o}",
        f"chmod go-w {path}",
    )


@needs_root
@pytest.mark.parametrize(
    "name",
    ["learner dir", "allowed dir", "actor dir", "learner secret", "actor secret", "allowed key", "actor's learner.key"],
)
def test_refuses_what_another_user_owns(key_dirs, name):
    path, load = _target(key_dirs, name)
    os.chown(path, OTHER_UID, -1)
    _refusal(
        load,
        key_dirs.learner if load is auth.load_learner_keys else key_dirs.actor,
        f"{path} is owned by uid {OTHER_UID}",
        "not by uid 0",
        f"chown root {path}",
    )
    os.chown(path, 0, -1)
    _load_both(key_dirs)


@pytest.mark.parametrize("name", ["learner secret", "actor secret", "allowed key", "actor's learner.key"])
def test_refuses_a_key_file_that_is_a_symbolic_link(key_dirs, tmp_path, name):
    path, load = _target(key_dirs, name)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    real = elsewhere / path.name
    path.rename(real)
    path.symlink_to(real)
    _refusal(
        load,
        key_dirs.learner if load is auth.load_learner_keys else key_dirs.actor,
        f"{path} is a symbolic link",
        f"rm {path} && cp {real} {path}",
    )


def test_refusals_are_value_errors_and_os_errors(key_dirs):
    """The CLI turns both into a one-line exit; ``keygen``'s caller catches only ValueError (and FileExistsError)."""
    (key_dirs.learner / "learner.key_secret").chmod(0o640)
    for kind in (ValueError, OSError):
        with pytest.raises(kind, match="chmod 600"):
            auth.load_learner_keys(key_dirs.learner)


def test_keygen_refuses_a_directory_others_can_write(tmp_path):
    directory = tmp_path / "keys"
    directory.mkdir()
    directory.chmod(0o777)
    with pytest.raises(ValueError, match=f"mode 0777.*chmod go-w {directory}"):
        auth.keygen(directory, "learner")
    assert not list(directory.iterdir())


@pytest.mark.process
def test_the_cli_refuses_unsafe_keys_in_one_line(key_dirs, tmp_path):
    (key_dirs.learner / "allowed").chmod(0o775)
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o700)
    loose.chmod(0o770)
    argvs = {
        "learner": [
            "learner",
            "--curve-keys",
            str(key_dirs.learner),
            "--logdir",
            str(tmp_path / "run"),
            "--listen",
            f"tcp://127.0.0.1:{free_port_pair()}",
        ],
        "keygen": ["keygen", str(loose), "--name", "actor"],
    }
    procs = {
        name: cli(*argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name, argv in argvs.items()
    }
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=30)
            assert proc.returncode != 0 and "listening" not in out, f"{name}\n{out}\n{err}"
            assert err.startswith("impala-async: ") and err.count("\n") == 1 and "chmod go-w" in err, f"{name}: {err}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert not list(loose.iterdir())


def test_local_actor_keys_makes_its_directory_private(key_dirs, tmp_path):
    """An earlier run's directory, or one made under a permissive umask, is made 0700 so that the checks pass."""
    local = tmp_path / "logdir" / ".local-actor-keys"
    local.mkdir(parents=True)
    local.chmod(0o777)
    (local / "learner.key").write_text("stale")
    old_umask = os.umask(0)
    try:
        directory, keys = auth.local_actor_keys(auth.load_learner_keys(key_dirs.learner), local)
    finally:
        os.umask(old_umask)
    assert directory == local and stat.S_IMODE(local.stat().st_mode) == 0o700
    actor = auth.load_actor_keys(local)
    assert keys.allowed[actor.public] == "local" and actor.server_public == keys.public


# ---------------------------------------------------------------------------------- synchronous context, ZAP thread
@pytest.fixture
def sync_context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_thread_authenticator_names_the_sender(key_dirs, sync_context):
    keys = auth.load_learner_keys(key_dirs.learner)
    authenticator = auth.start_thread_authenticator(sync_context, keys)
    try:
        pull = sync_context.socket(zmq.PULL)
        auth.make_curve_server(pull, keys)
        push = _client(sync_context, zmq.PUSH, _bind_local(pull), key_dirs.actor)
        push.send(b"trajectory")
        assert pull.poll(EVENT_TIMEOUT_S * 1000)
        frame = pull.recv(copy=False)
        assert (frame.bytes, frame.get("User-Id")) == (b"trajectory", ACTOR_NAME)
        push.close(0)
        pull.close(0)
    finally:
        auth.stop_authenticator(authenticator)


# The ZAP refusal of an unlisted key is the server's decision: always HANDSHAKE_FAILED_AUTH. A plain client and the
# server both notice the mechanism mismatch, and whichever closes first decides what the server reports (seen:
# HANDSHAKE_FAILED_PROTOCOL or HANDSHAKE_FAILED_NO_DETAIL, each followed by DISCONNECTED); never a successful handshake.
@pytest.mark.parametrize(
    ("client", "rejections"),
    [
        ("stranger", {zmq.EVENT_HANDSHAKE_FAILED_AUTH}),
        ("plain", {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_DISCONNECTED}),
    ],
)
def test_rejected_push_delivers_nothing(key_dirs, sync_context, client, rejections):
    with _curve_server(sync_context, key_dirs, zmq.PULL) as (pull, monitor, endpoint):
        rejected = _client(sync_context, zmq.PUSH, endpoint, key_dirs.stranger if client == "stranger" else None)
        rejected.send(b"intruder")
        outcome = _wait_for_event(monitor, rejections | {zmq.EVENT_HANDSHAKE_SUCCEEDED})
        assert outcome in rejections, f"handshake outcome {zmq.Event(outcome).name}"
        assert not pull.poll(NOTHING_ARRIVES_S * 1000), "a rejected client delivered a message"
        admitted = _client(sync_context, zmq.PUSH, endpoint, key_dirs.actor)  # the server still works
        admitted.send(b"trajectory")
        assert pull.poll(EVENT_TIMEOUT_S * 1000), "the admitted client's message did not arrive"
        frame = pull.recv(copy=False)
        assert (frame.bytes, frame.get("User-Id")) == (b"trajectory", ACTOR_NAME)
        for socket in (rejected, admitted):
            socket.close(0)


def test_pub_reaches_only_admitted_subscribers(key_dirs, sync_context):
    with _curve_server(sync_context, key_dirs, zmq.PUB) as (pub, monitor, endpoint):
        admitted = _client(sync_context, zmq.SUB, endpoint, key_dirs.actor)
        stranger = _client(sync_context, zmq.SUB, endpoint, key_dirs.stranger)
        _wait_for_event(monitor, {zmq.EVENT_HANDSHAKE_FAILED_AUTH})

        deadline = time.monotonic() + EVENT_TIMEOUT_S  # subscriptions take a moment to reach the PUB: publish until
        while not admitted.poll(PUBLISH_INTERVAL_S * 1000):  # the admitted subscriber gets one
            assert time.monotonic() < deadline, "the admitted subscriber received no weights"
            pub.send(b"weights")
        assert admitted.recv() == b"weights"

        admitted_received, window_end = 0, time.monotonic() + NOTHING_ARRIVES_S
        while time.monotonic() < window_end:
            pub.send(b"weights")
            assert not stranger.poll(PUBLISH_INTERVAL_S * 1000), "an unlisted subscriber received weights"
            while admitted.poll(0):
                admitted_received += admitted.recv() == b"weights"
        assert admitted_received > 0
        for socket in (admitted, stranger):
            socket.close(0)


def test_curve_server_without_authenticator_fails_closed(key_dirs, sync_context):
    """libzmq admits any key when no ZAP handler listens, unless ZAP_ENFORCE_DOMAIN is set (make_curve_server)."""
    pull = sync_context.socket(zmq.PULL)
    auth.make_curve_server(pull, auth.load_learner_keys(key_dirs.learner))
    monitor = pull.get_monitor_socket()
    push = _client(sync_context, zmq.PUSH, _bind_local(pull), key_dirs.stranger)
    push.send(b"intruder")
    outcome = _wait_for_event(monitor, {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_SUCCEEDED})
    assert outcome == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    assert not pull.poll(NOTHING_ARRIVES_S * 1000), "an unauthenticated client delivered a message"
    pull.disable_monitor()
    for socket in (monitor, push, pull):
        socket.close(0)


# ------------------------------------------------------------------------------------------------ refuse_insecure
@pytest.mark.parametrize(
    "listen",
    [
        "tcp://0.0.0.0:5555",
        "tcp://*:5555",
        "tcp://192.168.1.7:5555",
        "tcp://learner.example.org:5555",
        "tcp://eth0:5555",
    ],
)
def test_refuse_insecure_refuses_reachable_addresses_without_curve(listen):
    with pytest.raises(ValueError, match="without CURVE"):
        auth.refuse_insecure(listen, "tcp://127.0.0.1:5556", curve=False, insecure=False)
    with pytest.raises(ValueError, match="without CURVE"):
        auth.refuse_insecure("tcp://127.0.0.1:5555", listen, curve=False, insecure=False)
    auth.refuse_insecure(listen, listen, curve=False, insecure=True)
    auth.refuse_insecure(listen, listen, curve=True, insecure=False)


@pytest.mark.parametrize(
    "address",
    [
        "tcp://127.0.0.1:5555",
        "tcp://127.0.0.1:*",
        "tcp://localhost:5555",
        "tcp://[::1]:5555",
        "ipc:///tmp/impala.sock",
        "inproc://learner",
    ],
)
def test_refuse_insecure_allows_local_addresses(address):
    auth.refuse_insecure(address, address, curve=False, insecure=False)
