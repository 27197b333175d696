"""Property-based fuzzing of the trajectory decoder (impala_async.core.TrajectoryDecoder), in-process.

Whatever the bytes, ``parse`` and ``decode_into`` either succeed or raise ``wire.Rejected``: any other exception would
escape ``Ingest.handle`` and stop the learner's receive loop. When they succeed, the decoded arrays hold only values the
spec allows (actions in range, flags 0 or 1, floats finite), and for honest messages they hold exactly what was sent.

Inputs: arbitrary bytes; byte-level mutations (flip, insert, delete, overwrite) of valid messages; structural mutations
of valid messages (decoded with msgpack, keys and values replaced by arbitrary MessagePack values, re-packed); and
arbitrary values poked into the arrays of otherwise valid messages, against an oracle of the expected verdict.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import lz4.block
import msgpack
import numpy as np
import pytest
from helpers import FUZZ_LIMITS, FUZZ_SPECS, assert_values_allowed, random_arrays
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from impala_async.core import wire
from impala_async.core.decoder import TrajectoryDecoder
from impala_async.core.spec import CHECK_ACTION, CHECK_FINITE, CHECK_FLAG, TrajectorySpec

ROOT = Path(__file__).resolve().parent.parent
SPECS, LIMITS = FUZZ_SPECS, FUZZ_LIMITS
# The decoder finds NaN and infinity as a NaN dot product; numpy warns about it, which is expected here.
DECODERS = {name: TrajectoryDecoder(spec, LIMITS) for name, spec in SPECS.items()}
FUZZ = settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def valid_message(spec_name: str, n: int, codec: str, seed: int = 0) -> bytes:
    spec = SPECS[spec_name]
    return wire.encode_trajectories(
        spec,
        actor_id=f"fuzz/{seed}",
        seq=seed,
        policy_version=2,
        incarnation=1,
        arrays=random_arrays(spec, n, seed=seed),
        episodes=[(1.5, 3)],
        codec=codec,
        sent_at_ns=10**18,
    )


SEEDS = {
    (s, n, c): valid_message(s, n, c, seed=i)
    for i, (s, n, c) in enumerate((s, n, c) for s in SPECS for n in (1, 3) for c in wire.CODECS)
}


def destinations(spec: TrajectorySpec, n: int) -> dict[str, np.ndarray]:
    """Correctly sized destinations, filled with a pattern a skipped write would leave visible."""
    return {f.name: np.full((n, *f.shape), 0xAB if f.dtype == np.uint8 else -7, f.dtype) for f in spec.fields}


def decode(spec_name: str, data: bytes):
    """parse + decode_into. Returns (message, arrays), or None if rejected; any other exception fails the test."""
    decoder = DECODERS[spec_name]
    try:
        msg = decoder.parse(data)
        dest = destinations(decoder.spec, msg.n)
        decoder.decode_into(msg, dest)
    except wire.Rejected as e:
        assert e.reason in wire.REJECT_REASONS
        event(e.reason)  # --hypothesis-show-statistics shows how deep the inputs get
        return None
    event("accepted")
    return msg, dest


def assert_invariants(spec: TrajectorySpec, msg: wire.TrajectoryMessage, dest: dict[str, np.ndarray]) -> None:
    """What every accepted message guarantees to the learner."""
    assert type(msg.actor_id) is str and 1 <= len(msg.actor_id.encode()) <= LIMITS.max_actor_id_bytes
    assert type(msg.seq) is int and 0 <= msg.seq < 1 << 63
    assert type(msg.policy_version) is int and 0 <= msg.policy_version < 1 << 63
    assert type(msg.n) is int and 1 <= msg.n <= LIMITS.max_trajectories_per_message
    assert msg.sent_at_ns is None or (type(msg.sent_at_ns) is int and 0 <= msg.sent_at_ns < 1 << 63)
    assert len(msg.episodes) <= LIMITS.max_episodes_per_message
    for ret, length in msg.episodes:
        assert type(ret) in (int, float) and np.isfinite(ret) and type(length) is int and length >= 1
    assert_values_allowed(spec, dest)


# ------------------------------------------------------------------------------------------------ arbitrary bytes
@FUZZ
@given(data=st.binary(max_size=2048), spec_name=st.sampled_from(sorted(SPECS)))
def test_arbitrary_bytes_are_rejected_or_decoded(data, spec_name):
    out = decode(spec_name, data)
    if out is not None:
        assert_invariants(SPECS[spec_name], *out)


# A MessagePack prefix that gets past the first checks, then arbitrary bytes.
@FUZZ
@given(tail=st.binary(max_size=512), spec_name=st.sampled_from(sorted(SPECS)))
def test_arbitrary_bytes_after_a_valid_header_start(tail, spec_name):
    head = msgpack.packb({"v": 1, "type": "trajectories"})[1:]  # the map's entries without its length byte
    out = decode(spec_name, b"\x88" + head + tail)
    if out is not None:
        assert_invariants(SPECS[spec_name], *out)


# ------------------------------------------------------------------------------------------ byte-level mutations
_edit = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(1, 255)),
    st.tuples(st.just("set"), st.integers(0, 1 << 20), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 20), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 20), st.integers(1, 16)),
)


def apply_edits(data: bytes, edits) -> bytes:
    buf = bytearray(data)
    for op, pos, arg in edits:
        i = pos % (len(buf) + 1)
        if op == "insert":
            buf[i:i] = arg
        elif not buf:
            continue
        elif op == "delete":
            del buf[i % len(buf) : i % len(buf) + arg]
        elif op == "flip":
            buf[i % len(buf)] ^= arg
        else:
            buf[i % len(buf)] = arg
    return bytes(buf)


@FUZZ
@given(seed=st.sampled_from(sorted(SEEDS)), edits=st.lists(_edit, min_size=1, max_size=4))
def test_byte_mutations_of_valid_messages(seed, edits):
    spec_name = seed[0]
    out = decode(spec_name, apply_edits(SEEDS[seed], edits))
    if out is not None:
        assert_invariants(SPECS[spec_name], *out)


# ------------------------------------------------------------------------------------------ structural mutations
# Arbitrary MessagePack values, with string and bin map keys (bin keys once crashed the server: see
# test_bin_map_keys_are_rejected below).
_ints = st.one_of(
    st.integers(-3, 300),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.sampled_from([0, 1, 2, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, (1 << 63) - 1, 1 << 63]),
)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    _ints,
    st.floats(),
    st.text(max_size=80),
    st.binary(max_size=600),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8)),
    st.sampled_from(["<f4", "<i4", "|u1", "<f8", "float32", "lz4", "none", "jpeg", "trajectories"]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=20), inner, max_size=6)),
    max_leaves=12,
)
_keys = st.one_of(
    st.sampled_from(
        [
            "v",
            "type",
            "actor",
            "seq",
            "policy_version",
            "n",
            "episodes",
            "fields",
            "sent_at_ns",
            "obs",
            "action",
            "reward",
            "terminated",
            "truncated",
            "truncation_value",
            "behaviour_logits",
            "dtype",
            "shape",
            "codec",
            "data",
        ]
    ),
    st.text(max_size=20),
    st.binary(max_size=8),
)


def _payload_values(spec: TrajectorySpec, name: str):
    """Payloads that are nearly right for field ``name``: right or wrong size, lz4 or raw, honest header or not."""
    nbytes = spec.field_map[name].nbytes
    sizes = st.sampled_from([0, 1, nbytes - 1, nbytes, nbytes + 1, 2 * nbytes, 3 * nbytes])
    return st.one_of(
        st.builds(lambda k, b: bytes(b[:1] or b"\0") * k, sizes, st.binary(max_size=1)),
        st.builds(lambda k, b: lz4.block.compress((b * k)[:k]), sizes, st.binary(min_size=1, max_size=4)),
        st.builds(lambda k, b: k.to_bytes(4, "little") + b, sizes, st.binary(max_size=64)),
        st.builds(
            lambda k, b: (k % (1 << 32)).to_bytes(4, "little") + lz4.block.compress(b, store_size=False),
            st.one_of(sizes, st.integers(0, (1 << 32) - 1)),
            st.binary(max_size=3 * nbytes),
        ),
    )


@st.composite
def structural_mutation(draw):
    seed = draw(st.sampled_from(sorted(SEEDS)))
    spec = SPECS[seed[0]]
    msg = msgpack.unpackb(SEEDS[seed], raw=False)
    for _ in range(draw(st.integers(1, 3))):
        # Where: the top-level map, the fields map, or one field's map (payloads there, to get past parse often).
        where = draw(st.sampled_from(["top", "fields", "entry", "entry", "entry"]))
        target = msg
        name = draw(st.sampled_from([f.name for f in spec.fields]))
        if where != "top":
            target = msg.get("fields")
            if where == "entry" and isinstance(target, dict):
                target = target.get(name)
        if not isinstance(target, dict):
            continue
        op = draw(st.sampled_from(["set", "delete", "payload", "payload"]))
        if op == "payload" and where == "entry":
            target["data"] = draw(_payload_values(spec, name))
            target["codec"] = draw(st.sampled_from(["lz4", "none", "jpeg", target.get("codec")]))
        elif op == "delete" and target:
            del target[draw(st.sampled_from(sorted(target, key=repr)))]
        else:
            key = draw(st.one_of(st.sampled_from(sorted(target, key=repr)), _keys)) if target else draw(_keys)
            target[key] = draw(_values)
    return seed[0], msgpack.packb(msg, use_bin_type=True)


@FUZZ
@given(case=structural_mutation())
def test_structural_mutations_of_valid_messages(case):
    spec_name, data = case
    out = decode(spec_name, data)
    if out is not None:
        assert_invariants(SPECS[spec_name], *out)


# ------------------------------------------------------------------------------------- payloads against an oracle
PAYLOAD_KINDS = ("none", "lz4", "lz4_short", "lz4_long", "garbage")


@st.composite
def payload_mutation(draw):
    """A valid message whose payloads are replaced: honest (raw or LZ4) with arbitrary or valid content, LZ4 blocks
    decompressing to a byte too few or too many under a header giving the right size, or garbage after that header."""
    spec_name, n = draw(st.sampled_from(sorted(SPECS))), draw(st.sampled_from([1, 3]))
    spec = SPECS[spec_name]
    msg = msgpack.unpackb(SEEDS[(spec_name, n, "lz4")], raw=False)
    valid = random_arrays(spec, n, seed=draw(st.integers(0, 3)))
    plan = {}
    for f in spec.fields:
        nbytes = n * f.nbytes
        if draw(st.booleans()):  # leave this field valid (its content from ``valid``, not from the seed message)
            content, kind = valid[f.name].tobytes(), "lz4"
        else:
            content = draw(st.one_of(st.just(valid[f.name].tobytes()), st.binary(min_size=nbytes, max_size=nbytes)))
            kind = draw(st.sampled_from(PAYLOAD_KINDS))
        header = nbytes.to_bytes(4, "little")
        entry = msg["fields"][f.name]
        entry["codec"] = "none" if kind == "none" else "lz4"
        entry["data"] = {
            "none": content,
            "lz4": lz4.block.compress(content),
            "lz4_short": header + lz4.block.compress(content[:-1], store_size=False),
            "lz4_long": header + lz4.block.compress(content + b"\0", store_size=False),
            "garbage": header + draw(st.binary(min_size=1, max_size=2 * nbytes)),
        }[kind]
        plan[f.name] = (kind, content)
    return spec_name, msgpack.packb(msg, use_bin_type=True), plan


def _verdict(field, a: np.ndarray, num_actions: int) -> str | None:
    if field.check == CHECK_FINITE and not np.isfinite(a).all():
        return "nonfinite"
    if field.check == CHECK_ACTION and not ((a >= 0) & (a < num_actions)).all():
        return "bad_action"
    if field.check == CHECK_FLAG and not np.isin(a, (0, 1)).all():
        return "bad_flag"
    return None


def _cross_verdict(values: dict[str, np.ndarray], records: int = 0) -> str | None:
    """The rules between fields (docs/protocol.md): not terminated and truncated at once; a truncation value only
    where the step was truncated; no more episode records than the steps end episodes."""
    term, trunc = values["terminated"], values["truncated"]
    if (term & trunc).any() or (values["truncation_value"][trunc == 0] != 0).any():
        return "inconsistent"
    if records > int(term.sum()) + int(trunc.sum()):
        return "inconsistent"
    return None


@FUZZ
@given(case=payload_mutation())
def test_payload_mutations_against_an_oracle(case):
    spec_name, data, plan = case
    spec, decoder = SPECS[spec_name], DECODERS[spec_name]
    msg = decoder.parse(data)  # every size header and raw length is right: parse must pass
    dest = destinations(spec, msg.n)
    want, certain = None, True  # the first field, in spec order, that must fail; unknowable after garbage
    for f in spec.fields:
        kind, content = plan[f.name]
        if kind == "garbage":
            certain = False
            break
        if kind in ("lz4_short", "lz4_long"):
            want = "bad_lz4"
            break
        want = _verdict(f, np.frombuffer(content, f.dtype), spec.num_actions)
        if want:
            break
    else:
        want = _cross_verdict(
            {
                name: np.frombuffer(plan[name][1], spec.field_map[name].dtype)
                for name in ("terminated", "truncated", "truncation_value")
            },
            len(msg.episodes),
        )
    try:
        decoder.decode_into(msg, dest)
    except wire.Rejected as e:
        event(e.reason)
        if certain:
            assert e.reason == want, (e.reason, want)
        else:
            assert want is None and e.reason in ("bad_lz4", "nonfinite", "bad_action", "bad_flag", "inconsistent")
        return
    event("accepted")
    assert want is None, f"accepted a message that must be rejected as {want}"
    assert_invariants(spec, msg, dest)
    for f in spec.fields:
        kind, content = plan[f.name]
        if kind in ("none", "lz4"):
            assert dest[f.name].tobytes() == content, f.name  # honest payloads arrive bit for bit


# ------------------------------------------------------------------------------- array values against an oracle
def _value(field):
    if field.check == CHECK_FINITE:
        return st.floats(width=32)  # NaN and infinities included
    if field.check == CHECK_ACTION:
        return st.one_of(st.integers(-2, 8), st.integers(-(1 << 31), (1 << 31) - 1))
    return st.integers(0, 255)  # flags and uint8 pixels


@st.composite
def poked_arrays(draw):
    spec_name = draw(st.sampled_from(sorted(SPECS)))
    spec = SPECS[spec_name]
    n = draw(st.integers(1, 4))
    arrays = random_arrays(spec, n, seed=draw(st.integers(0, 3)))
    for _ in range(draw(st.integers(0, 3))):
        f = draw(st.sampled_from(spec.fields))
        a = arrays[f.name].reshape(-1)
        a[draw(st.integers(0, a.size - 1))] = draw(_value(f))
    return spec_name, arrays, draw(st.sampled_from(wire.CODECS))


def expected_reason(spec: TrajectorySpec, arrays) -> str | None:
    """The oracle: the reason of the first field, in spec order, that holds a value the spec forbids."""
    for f in spec.fields:
        a = arrays[f.name]
        if f.check == CHECK_FINITE and not np.isfinite(a).all():
            return "nonfinite"
        if f.check == CHECK_ACTION and not ((a >= 0) & (a < spec.num_actions)).all():
            return "bad_action"
        if f.check == CHECK_FLAG and not np.isin(a, (0, 1)).all():
            return "bad_flag"
    return _cross_verdict(arrays)


@FUZZ
@given(case=poked_arrays())
def test_array_values_are_checked_exactly(case):
    spec_name, arrays, codec = case
    spec, decoder = SPECS[spec_name], DECODERS[spec_name]
    data = wire.encode_trajectories(
        spec, actor_id="a", seq=0, policy_version=0, incarnation=1, arrays=arrays, codec=codec
    )
    msg = decoder.parse(data)  # the header is valid whatever the values
    dest = destinations(spec, msg.n)
    want = expected_reason(spec, arrays)
    if want is None:
        decoder.decode_into(msg, dest)  # valid values are never refused ...
        for name, a in arrays.items():  # ... and arrive bit for bit
            assert dest[name].tobytes() == a.tobytes(), name
    else:
        with pytest.raises(wire.Rejected) as e:
            decoder.decode_into(msg, dest)
        assert e.value.reason == want


BIG = TrajectorySpec(obs_shape=(1000,), obs_dtype="float32", num_actions=2, unroll_length=9)  # 10^4 obs floats
BIG_N = 8  # 8 * 10^4 obs floats in one message: more than one wire.FINITE_CHUNK


@settings(max_examples=60, deadline=None, database=None)
@given(
    index=st.one_of(
        st.integers(0, BIG_N * 10_000 - 1),
        st.sampled_from([0, wire.FINITE_CHUNK - 1, wire.FINITE_CHUNK, BIG_N * 10_000 - 1]),
    ),
    value=st.sampled_from([np.nan, np.inf, -np.inf]),
    codec=st.sampled_from(wire.CODECS),
)
def test_one_nonfinite_anywhere_in_a_large_message_is_found(index, value, codec):
    assert BIG_N * 10_000 > wire.FINITE_CHUNK
    decoder = TrajectoryDecoder(BIG, wire.WireLimits(max_trajectories_per_message=BIG_N))
    arrays = random_arrays(BIG, BIG_N, seed=5)
    arrays["obs"].reshape(-1)[index] = value
    msg = decoder.parse(
        wire.encode_trajectories(BIG, actor_id="a", seq=0, policy_version=0, incarnation=1, arrays=arrays, codec=codec)
    )
    with pytest.raises(wire.Rejected, match="nonfinite"):
        decoder.decode_into(msg, destinations(BIG, BIG_N))


# ------------------------------------------------------ found by fuzzing: bin map keys once crashed the server
@pytest.mark.parametrize("where", ["top", "fields"])
def test_bin_map_keys_are_rejected(where):
    msg = msgpack.unpackb(SEEDS[("vector", 1, "lz4")], raw=False)
    (msg if where == "top" else msg["fields"])[b"x"] = 1
    with pytest.raises(wire.Rejected) as e:
        DECODERS["vector"].parse(msgpack.packb(msg, use_bin_type=True))
    assert e.value.reason in ("malformed", "bad_header", "bad_field")


@pytest.mark.process
def test_the_libfuzzer_tool_runs_in_its_smallest_mode(tmp_path):
    """tools/fuzz_decoder.py (atheris, coverage-guided) for 2 s on the image spec: libFuzzer finds no input that breaks
    the property above (it would stop, write crash-*, and exit non-zero), and a corpus file replays. A process of its
    own, not the fork server's: atheris instruments only modules imported after it starts."""
    pytest.importorskip("atheris", reason="tools/fuzz_decoder.py needs atheris (wheels for Linux x86-64)")
    tool, corpus = [sys.executable, str(ROOT / "tools" / "fuzz_decoder.py")], tmp_path / "corpus"
    out = subprocess.run([*tool, "--seconds", "2", "--spec", "image", "--corpus", str(corpus)], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0 and not list(tmp_path.glob("crash-*")), out.stderr[-3000:]
    runs = re.search(r"Done (\d+) runs in", out.stderr)
    assert runs and int(runs.group(1)) > 100, out.stderr[-3000:]
    replay = subprocess.run([*tool, "--spec", "image", "--replay", str(corpus / "seed-0")], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert replay.returncode == 0 and replay.stdout.strip() == "no crash", replay.stderr[-2000:]
