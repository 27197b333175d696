"""CurveZMQ encryption and ZAP authentication for the learner's sockets.

Without CURVE, anyone who can reach the learner's ports can push trajectories into training and read the weights.
With CURVE, both sockets (PULL for trajectories, PUB for weights) are encrypted, and a ZAP authenticator admits only
the actors whose public keys the learner lists.

Key files are ZeroMQ certificates as written by ``zmq.auth`` (readable by ``zmq.auth.load_certificate``):
``NAME.key`` holds the public key (shareable), ``NAME.key_secret`` the public and secret key (mode 0600, never
shared). ``keygen(directory, name)`` writes such a pair.

Learner key directory (``--curve-keys DIR`` on the learner)::

    DIR/learner.key_secret       the learner's own key pair (mode 0600)
    DIR/learner.key              its public key: copy it to every actor machine
    DIR/allowed/NAME.key         public key of each admitted actor; NAME (the file stem) is the actor's name

Actor key directory (``--curve-keys DIR`` on an actor machine)::

    DIR/actor.key_secret         this actor machine's key pair (mode 0600)
    DIR/actor.key                its public key: copy it to the learner as DIR/allowed/NAME.key
    DIR/learner.key              the learner's public key

What is checked when keys are loaded (as OpenSSH's StrictModes does; a refusal names the path and the fix):

- the key directory and ``allowed/``: owned by you or root, not writable by group or others (mode bits 0o022);
- ``*.key_secret``: a regular file owned by you (the effective uid), no access for group or others (0600 or 0400);
- ``allowed/*.key`` and the actor's ``learner.key``: regular files owned by you or root, not writable by group or
  others (a public key may be readable by anyone).

Symbolic links: a key directory given on the command line (or ``allowed/``) may be a link; the directory it leads to
is checked. A key file must not be a link: the checks on its directory are what keep others from swapping it, and a
link would lead out of that protection (replace it with a copy). Directories above the key directory are not checked.
Refusals are ``UnsafeKeyFileError``, both a PermissionError and a ValueError.

Each received message carries the ZAP User-Id of its sender: ``frame.get("User-Id")`` on a frame received with
``recv(copy=False)`` is the actor's NAME, so the learner can bind actor ids to keys.

Order matters: start the authenticator on the socket's context before binding. libzmq admits any client key when no
ZAP handler is listening, unless ZAP_ENFORCE_DOMAIN is set; ``make_curve_server`` sets it where libzmq supports it.
"""

from __future__ import annotations

import datetime
import logging
import os
import pwd
import re
import shlex
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.auth import load_certificate
from zmq.auth.base import Authenticator
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from ..core.address import is_local

log = logging.getLogger("impala_async.ops.auth")

ZAP_DOMAIN = "impala-async"
LEARNER_NAME = "learner"
ACTOR_NAME = "actor"
ALLOWED_DIRNAME = "allowed"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
Z85_KEY_CHARS = 40  # a 32-byte Curve25519 key in z85
SECRET_FILE_MODE = 0o600
KEY_DIR_MODE = 0o700
PUBLIC_FILE_MODE = 0o644
WRITABLE_BY_OTHERS = 0o022  # group or others may write
_KEYGEN_HINT = "; create the key pair with `impala-async keygen DIR` (the key layout is in README.md, Security)"
KEY_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

_PUBLIC_BANNER = """#   ****  Generated on {now} by impala-async  ****
#   ZeroMQ CURVE Public Certificate
#   Copy this file to the other side (see impala_async/ops/auth.py for where it goes).

"""
_SECRET_BANNER = """#   ****  Generated on {now} by impala-async  ****
#   ZeroMQ CURVE **Secret** Certificate
#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.

"""


# ------------------------------------------------------------------------------------------------------ key files
def _certificate_text(banner: str, public: bytes, secret: bytes | None = None) -> str:
    """The text of a certificate in the format of ``zmq.auth.create_certificates``."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [banner.format(now=now), "metadata\n", "curve\n", f'    public-key = "{public.decode("ascii")}"\n']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode("ascii")}"\n')
    return "".join(lines)


def _write_new_file(path: Path, text: str, mode: int) -> None:
    """Create ``path`` with ``mode`` from the first byte on; fail if it exists (O_EXCL, no race)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)


def keygen(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write a new key pair: ``directory/name.key`` (public) and ``directory/name.key_secret`` (mode 0600).

    Creates ``directory`` with mode 0700 if missing; refuses an existing one that fails ``check_key_directory``, and
    to overwrite either file (FileExistsError). Returns ``(public_path, secret_path)``.
    """
    if not KEY_NAME_PATTERN.fullmatch(name):
        raise ValueError(f"key name {name!r}: use letters, digits, '.', '_' and '-', starting with a letter or digit")
    directory = Path(directory)
    directory.mkdir(mode=KEY_DIR_MODE, parents=True, exist_ok=True)
    check_key_directory(directory)  # an existing one too: write no key the loaders would refuse
    public_path = directory / f"{name}{PUBLIC_SUFFIX}"
    secret_path = directory / f"{name}{SECRET_SUFFIX}"
    for path in (public_path, secret_path):
        if os.path.lexists(path):
            raise FileExistsError(
                f"{path} exists; refusing to overwrite a key (delete it first if you mean to "
                f"replace it, and redistribute the new public key)"
            )
    public, secret = zmq.curve_keypair()
    _write_new_file(secret_path, _certificate_text(_SECRET_BANNER, public, secret), SECRET_FILE_MODE)
    try:
        _write_new_file(public_path, _certificate_text(_PUBLIC_BANNER, public), PUBLIC_FILE_MODE)
    except BaseException:
        secret_path.unlink()  # leave no half-written pair behind
        raise
    return public_path, secret_path


class UnsafeKeyFileError(PermissionError, ValueError):
    """A key file or directory that others could read or change. An OSError and a ValueError, so that each caller's
    ``except (ValueError, OSError)``, and ``keygen``'s ``except ValueError``, turns it into one line."""


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _who(uid: int) -> str:
    return f"uid {uid}" if _user(uid) == str(uid) else f"uid {uid} ({_user(uid)})"


def _check(
    path: str | os.PathLike,
    what: str,
    *,
    is_dir: bool = False,
    root_ok: bool = True,
    forbidden: int = WRITABLE_BY_OTHERS,
    fix: str = "go-w",
    missing: str = "",
) -> None:
    """Raise unless ``path`` is a directory (``is_dir``, a link is followed) or a regular file that is not a link,
    owned by the effective uid (or root, with ``root_ok``), with none of the ``forbidden`` mode bits."""
    quoted = shlex.quote(str(path))
    try:
        st = os.stat(path) if is_dir else os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} not found{missing}") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeKeyFileError(
            f"{what} {path} is a symbolic link: a key file must be a regular file in its key "
            f"directory; replace the link with a copy: rm {quoted} && cp "
            f"{shlex.quote(os.path.realpath(path))} {quoted}"
        )
    if not (stat.S_ISDIR if is_dir else stat.S_ISREG)(st.st_mode):
        raise ValueError(f"{what} {path} is not a {'directory' if is_dir else 'regular file'}")
    me = os.geteuid()
    if st.st_uid != me and not (root_ok and st.st_uid == 0):
        raise UnsafeKeyFileError(
            f"{what} {path} is owned by {_who(st.st_uid)}, not by {_who(me)} that runs "
            f"impala-async{' or by root' if root_ok and me != 0 else ''}; fix it with: "
            f"chown {_user(me)} {quoted}"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & forbidden:
        access = "writable" if forbidden == WRITABLE_BY_OTHERS else "accessible"
        raise UnsafeKeyFileError(
            f"{what} {path} is {access} by group or others (mode {mode:04o}); fix it with: chmod {fix} {quoted}"
        )


def check_key_directory(path: str | os.PathLike, what: str = "key directory") -> None:
    """Raise unless ``path`` (a link is followed) is a directory owned by you or root that group and others cannot
    write: FileNotFoundError, ValueError (not a directory) or UnsafeKeyFileError (saying ``chown``/``chmod go-w``)."""
    _check(path, what, is_dir=True, missing=_KEYGEN_HINT)


def check_secret_file(path: str | os.PathLike) -> None:
    """Raise unless ``path`` is a regular file (not a link) owned by the effective uid that only its owner may access.

    FileNotFoundError if it is missing; UnsafeKeyFileError (a PermissionError) saying ``chown`` if another user owns
    it, ``chmod 600`` if group or others have any access, and how to replace a symbolic link by a copy.
    """
    _check(
        path, "secret key file", root_ok=False, forbidden=stat.S_IRWXG | stat.S_IRWXO, fix="600", missing=_KEYGEN_HINT
    )


def check_public_file(path: str | os.PathLike) -> None:
    """Raise unless ``path`` is a regular file (not a link) owned by you or root that group and others cannot write:
    FileNotFoundError, ValueError or UnsafeKeyFileError (saying ``chown``/``chmod go-w``)."""
    _check(path, "public key file")


def _check_z85_key(key: bytes | None, what: str, path: Path) -> bytes:
    """Return ``key`` if it is a well-formed z85 Curve25519 key; else raise ValueError naming the file."""
    if key is None:
        raise ValueError(f"{path} holds no {what}")
    if len(key) != Z85_KEY_CHARS:
        raise ValueError(f"{path}: {what} is {len(key)} characters long, not {Z85_KEY_CHARS} (z85)")
    try:
        z85.decode(key)
    except (ValueError, KeyError, struct.error):
        raise ValueError(f"{path}: {what} is not valid z85") from None
    return key


def _load_key_pair(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a secret certificate, after checking its permissions and consistency."""
    check_secret_file(path)
    public, secret = load_certificate(path)
    public = _check_z85_key(public, "public key", path)
    secret = _check_z85_key(secret, "secret key", path)
    if zmq.curve_public(secret) != public:
        raise ValueError(f"{path}: the public key does not belong to the secret key")
    return public, secret


def _load_public_key(path: Path) -> bytes:
    """The z85 public key of a public certificate; refuses a file that also holds a secret key."""
    check_public_file(path)
    public, secret = load_certificate(path)
    if secret is not None:
        raise ValueError(
            f"{path} contains a secret key; a .key file must hold only the public key (use the "
            f"{PUBLIC_SUFFIX} file keygen wrote, not the {SECRET_SUFFIX} file)"
        )
    return _check_z85_key(public, "public key", path)


def _load_allowed(allowed_dir: Path) -> dict[bytes, str]:
    """Map each ``allowed_dir/NAME.key``'s z85 public key to NAME; refuse a missing or empty directory."""
    if not allowed_dir.is_dir():
        raise ValueError(
            f"{allowed_dir} does not exist: with CURVE the learner admits only actors whose public keys "
            f"are in it, so nobody could connect. Copy each actor's actor.key there as NAME.key"
        )
    check_key_directory(allowed_dir, "allowed-keys directory")
    allowed: dict[bytes, str] = {}
    for path in sorted(allowed_dir.glob(f"*{PUBLIC_SUFFIX}")):
        key, name = _load_public_key(path), path.name[: -len(PUBLIC_SUFFIX)]
        if key in allowed:
            raise ValueError(f"{path} holds the same key as {allowed[key]}{PUBLIC_SUFFIX}: one key, one name")
        allowed[key] = name
    if not allowed:
        raise ValueError(
            f"{allowed_dir} holds no *{PUBLIC_SUFFIX} file: with CURVE the learner admits only actors "
            f"whose public keys are there, so nobody could connect. Copy each actor's actor.key there "
            f"as NAME.key"
        )
    return allowed


@dataclass(frozen=True)
class LearnerKeys:
    """The learner's key pair and the actors it admits (z85 keys; ``allowed`` maps public key -> actor name)."""

    public: bytes
    secret: bytes = field(repr=False)
    allowed: dict[bytes, str]


@dataclass(frozen=True)
class ActorKeys:
    """An actor's key pair and the learner's public key (all z85)."""

    public: bytes
    secret: bytes = field(repr=False)
    server_public: bytes


def load_learner_keys(directory: str | os.PathLike) -> LearnerKeys:
    """Read ``directory/learner.key_secret`` and ``directory/allowed/*.key`` after checking them and both
    directories (see the module docstring)."""
    directory = Path(directory)
    check_key_directory(directory)
    public, secret = _load_key_pair(directory / f"{LEARNER_NAME}{SECRET_SUFFIX}")
    return LearnerKeys(public=public, secret=secret, allowed=_load_allowed(directory / ALLOWED_DIRNAME))


def load_actor_keys(directory: str | os.PathLike) -> ActorKeys:
    """Read ``directory/actor.key_secret`` and ``directory/learner.key`` after checking them and the directory (see
    the module docstring)."""
    directory = Path(directory)
    check_key_directory(directory)
    public, secret = _load_key_pair(directory / f"{ACTOR_NAME}{SECRET_SUFFIX}")
    server_path = directory / f"{LEARNER_NAME}{PUBLIC_SUFFIX}"
    if not server_path.is_file():
        raise FileNotFoundError(f"{server_path} not found: copy the learner's {LEARNER_NAME}{PUBLIC_SUFFIX} there")
    return ActorKeys(public=public, secret=secret, server_public=_load_public_key(server_path))


# --------------------------------------------------------------------------------------------------------- sockets
def make_curve_server(socket: zmq.Socket, keys: LearnerKeys) -> None:
    """Make ``socket`` a CURVE server authenticated by ZAP in domain ``impala-async``. Call before bind."""
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    _enforce_zap(socket)


def _enforce_zap(socket: zmq.Socket) -> None:
    """Fail closed when no authenticator runs: by default libzmq then admits every CURVE client key."""
    option = getattr(zmq, "ZAP_ENFORCE_DOMAIN", None)  # a draft option in libzmq 4.3's header
    if option is not None:
        try:
            socket.setsockopt(option, 1)
            return
        except zmq.ZMQError:
            pass
    log.warning(
        "this libzmq lacks ZAP_ENFORCE_DOMAIN: any client key is admitted unless the authenticator "
        "runs; start it before binding and keep it running until the socket is closed"
    )


def make_curve_client(socket: zmq.Socket, keys: ActorKeys) -> None:
    """Make ``socket`` a CURVE client of the learner. Call before connect."""
    socket.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


# --------------------------------------------------------------------------------------------------- authenticators
class _AllowedKeys:
    """Mixin for pyzmq authenticators: admit exactly ``allowed`` (z85 key -> name) and use the name as User-Id."""

    def _admit(self, allowed: dict[bytes, str]) -> None:
        self._allowed_names = dict(allowed)
        self._refused_keys: set[bytes] = set()
        self.handshakes_refused = 0  # CURVE handshakes refused for an unlisted key; written by its thread only
        self.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, z85_client_key: bytes) -> bool:
        """Credentials-provider hook: pyzmq passes the client's key in z85."""
        if z85_client_key in self._allowed_names:
            return True
        self.handshakes_refused += 1
        if z85_client_key not in self._refused_keys and len(self._refused_keys) < 1000:
            self._refused_keys.add(z85_client_key)  # clients retry every reconnect interval: warn once per key
            log.warning("refused a CURVE client with an unlisted public key %s", z85_client_key.decode("ascii"))
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        """User-Id of an admitted client: its name. pyzmq passes the raw 32-byte key here, not z85."""
        return self._allowed_names[z85.encode(client_public_key)]


class NamedThreadAuthenticator(_AllowedKeys, ThreadAuthenticator):
    """ThreadAuthenticator admitting a fixed set of CURVE keys, with User-Id = the key's name."""


def start_thread_authenticator(context: zmq.Context, keys: LearnerKeys) -> NamedThreadAuthenticator:
    """Start ZAP authentication on ``context`` in a background thread, admitting exactly ``keys.allowed``.

    Call before binding the CURVE sockets; one authenticator per context (it binds ``inproc://zeromq.zap.01``).
    Stop it with ``stop_authenticator``."""
    auth = NamedThreadAuthenticator(context, log=log.getChild("zap"))
    auth._admit(keys.allowed)
    auth.start()
    return auth


def stop_authenticator(auth: Authenticator) -> None:
    """Stop an authenticator after closing the CURVE sockets, before ``context.term()``."""
    auth.stop()


# ------------------------------------------------------------------------------------------------ insecure binding
def refuse_insecure(listen: str, publish: str, curve: bool, insecure: bool) -> None:
    """Raise ValueError if the learner would bind a non-loopback address without CURVE and without ``insecure``."""
    if curve or insecure:
        return
    exposed = [a for a in (listen, publish) if not is_local(a)]
    if exposed:
        raise ValueError(
            f"refusing to bind {' and '.join(exposed)} without CURVE: anyone who can reach it could push "
            f"trajectories into training and read the weights. Give --curve-keys DIR (keys from "
            f"`impala-async keygen DIR`), or bind to 127.0.0.1, or pass --insecure 1 on a network you trust"
        )


def local_actor_keys(keys: LearnerKeys, directory: Path) -> tuple[Path, LearnerKeys]:
    """A fresh key pair for the actors 'train' starts itself, admitted (as name 'local') for this run only.

    Makes ``directory`` mode 0700, writes ``directory/actor.key_secret`` (0600) and ``directory/learner.key`` and
    returns the directory and the learner's keys with the new public key added to ``allowed``. A previous run's
    local keys are replaced.
    """
    directory = Path(directory)
    directory.mkdir(mode=KEY_DIR_MODE, parents=True, exist_ok=True)
    os.chmod(directory, KEY_DIR_MODE)  # left by an earlier run or made under a permissive umask: what the checks want
    for stale in (f"{ACTOR_NAME}{PUBLIC_SUFFIX}", f"{ACTOR_NAME}{SECRET_SUFFIX}", f"{LEARNER_NAME}{PUBLIC_SUFFIX}"):
        (directory / stale).unlink(missing_ok=True)
    public_path, _ = keygen(directory, ACTOR_NAME)
    _write_new_file(
        directory / f"{LEARNER_NAME}{PUBLIC_SUFFIX}", _certificate_text(_PUBLIC_BANNER, keys.public), PUBLIC_FILE_MODE
    )
    allowed = {**keys.allowed, _load_public_key(public_path): "local"}
    return directory, LearnerKeys(public=keys.public, secret=keys.secret, allowed=allowed)
