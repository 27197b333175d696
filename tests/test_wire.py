"""The wire format: round trips, a message built by hand from docs/protocol.md, and every rejection reason."""

import lz4.block
import msgpack
import numpy as np
import pytest
from helpers import random_arrays

from impala_async.core import wire
from impala_async.core.decoder import TrajectoryDecoder
from impala_async.core.spec import TrajectorySpec


def empty_dest(spec: TrajectorySpec, n: int) -> dict[str, np.ndarray]:
    return {f.name: np.full((n, *f.shape), 0xAB if f.dtype == np.uint8 else -7, f.dtype) for f in spec.fields}


def decode_all(decoder, data):
    msg = decoder.parse(data)
    dest = empty_dest(decoder.spec, msg.n)
    decoder.decode_into(msg, dest)
    return msg, dest


@pytest.mark.parametrize("codec", wire.CODECS)
@pytest.mark.parametrize("spec_name", ["cartpole_spec", "atari_spec"])
def test_round_trip(codec, spec_name, request):
    spec = request.getfixturevalue(spec_name)
    arrays = random_arrays(spec, 3, seed=1)
    data = wire.encode_trajectories(
        spec,
        actor_id="host/1/ab",
        seq=7,
        policy_version=3,
        incarnation=1,
        arrays=arrays,
        episodes=[(12.5, 40), (3, 2)],
        codec=codec,
        sent_at_ns=123,
    )
    msg, dest = decode_all(TrajectoryDecoder(spec), data)
    assert (msg.actor_id, msg.seq, msg.policy_version, msg.n, msg.sent_at_ns) == ("host/1/ab", 7, 3, 3, 123)
    assert msg.episodes == [[12.5, 40], [3.0, 2]]
    for name, a in arrays.items():
        np.testing.assert_array_equal(dest[name], a, err_msg=name)


def handmade_message(spec: TrajectorySpec, arrays, **override) -> dict:
    """Built from docs/protocol.md alone: msgpack map, LZ4 block with a 4-byte little-endian size prefix."""
    fields = {}
    for f in spec.fields:
        raw = arrays[f.name].astype(f.dtype).tobytes()  # all n trajectories, trajectory-major
        fields[f.name] = {
            "dtype": f.dtype.str,
            "shape": list(f.shape),
            "codec": "lz4",
            "data": len(raw).to_bytes(4, "little") + lz4.block.compress(raw, store_size=False),
        }
    msg = {
        "v": 2,
        "type": "trajectories",
        "actor": "other-language-actor",
        "seq": 0,
        "policy_version": 0,
        "incarnation": 12345,
        "n": len(arrays["obs"]),
        "episodes": [],
        "fields": fields,
    }
    msg.update(override)
    return msg


def test_handmade_message_is_accepted(cartpole_spec):
    arrays = random_arrays(cartpole_spec, 2)
    data = msgpack.packb(handmade_message(cartpole_spec, arrays))
    _, dest = decode_all(TrajectoryDecoder(cartpole_spec), data)
    np.testing.assert_array_equal(dest["obs"], arrays["obs"])
    np.testing.assert_array_equal(dest["behaviour_logits"], arrays["behaviour_logits"])


def parse_reason(spec, data, limits=wire.WireLimits()):
    with pytest.raises(wire.Rejected) as e:
        decode_all(TrajectoryDecoder(spec, limits), data)
    return e.value.reason


def test_header_rejections(cartpole_spec):
    arrays = random_arrays(cartpole_spec, 1)
    spec = cartpole_spec

    def reason(**override):
        return parse_reason(spec, msgpack.packb(handmade_message(spec, arrays, **override)))

    assert reason(v=1) == "bad_version"  # protocol 1 had no incarnation
    assert reason(v=3) == "bad_version"
    assert reason(v=True) == "bad_version"
    assert reason(v=2.0) == "bad_version"
    assert reason(type="weights") == "bad_type"
    assert reason(actor="") == "bad_header"
    assert reason(actor="x" * 65) == "bad_header"
    assert reason(seq=-1) == "bad_header"
    assert reason(seq=1.5) == "bad_header"
    assert reason(policy_version="3") == "bad_header"
    assert reason(n=2) == "bad_size"  # payloads hold one trajectory, n says two
    assert reason(n=0) == "bad_header"
    assert reason(n=True) == "bad_header"
    assert reason(incarnation=0) == "bad_header"
    assert reason(incarnation=-5) == "bad_header"
    assert reason(incarnation=1.0) == "bad_header"
    assert reason(episodes=[[1.0]]) == "bad_header"
    assert reason(episodes=[[float("nan"), 3]]) == "bad_header"
    assert reason(episodes=[[1e300, 3]]) == "bad_header"  # beyond max_abs_episode_return: no absurd return means
    assert reason(episodes=[[1.0, 0]]) == "bad_header"
    assert reason(episodes=[[1.0, 1 << 50]]) == "bad_header"  # beyond max_episode_length_steps
    assert reason(episodes=[[1.0, 3.0]]) == "bad_header"
    assert reason(sent_at_ns=None) == "bad_header"  # leave the key out instead
    assert reason(sent_at_ns=1.5) == "bad_header"
    assert reason(extra=1) == "bad_header"
    for key in ("seq", "incarnation", "fields", "episodes"):
        msg = handmade_message(spec, arrays)
        del msg[key]
        assert parse_reason(spec, msgpack.packb(msg)) == "bad_header", key
    # A repeated key (msgpack would keep the last one silently) and trailing bytes.
    packed = msgpack.packb(handmade_message(spec, arrays))
    doubled = bytes([packed[0] + 1]) + packed[1:] + msgpack.packb("seq") + msgpack.packb(9)
    assert parse_reason(spec, doubled) == "bad_header"
    assert parse_reason(spec, packed + b"\x00") == "malformed"


def test_field_rejections(cartpole_spec):
    spec = cartpole_spec
    arrays = random_arrays(spec, 1)

    def reason(mutate):
        msg = handmade_message(spec, arrays)
        mutate(msg["fields"])
        return parse_reason(spec, msgpack.packb(msg))

    assert reason(lambda f: f.pop("reward")) == "bad_field"
    assert reason(lambda f: f["obs"].update(dtype="<f8")) == "bad_field"
    assert reason(lambda f: f["obs"].update(dtype="|O")) == "bad_field"
    assert reason(lambda f: f["obs"].update(shape=[6, 5])) == "bad_field"
    T1 = spec.unroll_length + 1
    assert reason(lambda f: f["obs"].update(shape=[float(T1), 4.0])) == "bad_field"  # == [T+1, 4] in Python
    assert reason(lambda f: f["obs"].update(shape=[True, 4])) == "bad_field"
    assert reason(lambda f: f["obs"].update(extra=1)) == "bad_field"
    assert reason(lambda f: f["obs"].update(codec="zstd")) == "bad_field"
    assert reason(lambda f: f["obs"].update(data="not bytes")) == "bad_field"
    assert reason(lambda f: f["obs"].update(data=[f["obs"]["data"]])) == "bad_field"
    # LZ4 size prefix disagreeing with the spec: rejected before any decompression.
    huge = (2**31 - 1).to_bytes(4, "little")
    assert reason(lambda f: f["obs"].update(data=huge + f["obs"]["data"][4:])) == "bad_size"
    # Valid LZ4 of the wrong size, with a truthful prefix ...
    short = np.zeros(10, np.float32).tobytes()
    assert reason(lambda f: f["obs"].update(data=lz4.block.compress(short))) == "bad_size"
    # ... and with a lying prefix: the block itself decompresses to too few bytes.
    nbytes = spec.field_map["obs"].nbytes
    lying = nbytes.to_bytes(4, "little") + lz4.block.compress(short, store_size=False)
    assert reason(lambda f: f["obs"].update(data=lying)) == "bad_lz4"
    garbage = nbytes.to_bytes(4, "little") + b"\xff" * 40
    assert reason(lambda f: f["obs"].update(data=garbage)) == "bad_lz4"
    # Raw bytes of the wrong length.
    assert reason(lambda f: f["reward"].update(codec="none", data=b"\0" * 7)) == "bad_size"


@pytest.mark.parametrize(
    "field,value,why",
    [
        ("reward", np.nan, "nonfinite"),
        ("behaviour_logits", np.inf, "nonfinite"),
        ("obs", -np.inf, "nonfinite"),
        ("truncation_value", np.nan, "nonfinite"),
        ("action", 2, "bad_action"),
        ("action", -1, "bad_action"),
        ("terminated", 2, "bad_flag"),
        ("truncated", 255, "bad_flag"),
    ],
)
def test_value_rejections(cartpole_spec, field, value, why):
    arrays = random_arrays(cartpole_spec, 3)
    decoder = TrajectoryDecoder(cartpole_spec)
    decode_all(
        decoder,
        wire.encode_trajectories(cartpole_spec, actor_id="a", seq=0, policy_version=0, incarnation=1, arrays=arrays),
    )
    arrays[field][1].flat[-1] = value  # one bad value in the middle trajectory rejects the whole message
    for codec in wire.CODECS:
        data = wire.encode_trajectories(
            cartpole_spec, actor_id="a", seq=0, policy_version=0, incarnation=1, arrays=arrays, codec=codec
        )
        with pytest.raises(wire.Rejected) as e:
            decode_all(decoder, data)
        assert e.value.reason == why


def test_limits(cartpole_spec):
    spec = cartpole_spec
    arrays = random_arrays(spec, 4)
    data = wire.encode_trajectories(spec, actor_id="a", seq=0, policy_version=0, incarnation=1, arrays=arrays)
    assert parse_reason(spec, data, wire.WireLimits(max_message_bytes=len(data) - 1)) == "too_large"
    assert parse_reason(spec, data, wire.WireLimits(max_trajectories_per_message=3)) == "bad_header"
    eps = [(1.0, 1)] * 5
    data = wire.encode_trajectories(
        spec, actor_id="a", seq=0, policy_version=0, incarnation=1, arrays=arrays, episodes=eps
    )
    assert parse_reason(spec, data, wire.WireLimits(max_episodes_per_message=4)) in ("malformed", "bad_header")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00",
        b"\xc1",
        b"\xdd\xff\xff\xff\xff",
        b"\xdf\xff\xff\xff\xff",  # never-used byte, huge array/map
        b"\x91" * 100_000 + b"\xc0",  # 10^5 levels of nesting
        msgpack.packb({"v": 1, "type": "trajectories", "x": msgpack.ExtType(1, b"abc")}),  # extension type
        msgpack.packb({1: 2}),  # non-string map key
        msgpack.packb([1, 2, 3]),
        b"\xc6\xff\xff\xff\xff",  # bin32 claiming 4 GiB
    ],
)
def test_hostile_msgpack(cartpole_spec, data):
    assert parse_reason(cartpole_spec, data) in ("malformed", "bad_version", "bad_header")


def test_parse_work_is_bounded_by_the_layout(cartpole_spec):
    """16 MiB of nested 4096-element arrays is 16.7M objects, which msgpack.unpackb builds in seconds and a GiB
    before anything checks them. In any header position the reader stops at the first value of the wrong kind."""
    import time

    row = b"\xdc\x10\x00" + b"\x01" * 4096  # array16 of 4096 fixints
    tree = b"\xdc\x10\x00" + row * 4095  # ... 4096 of them: 16 MiB
    limits = wire.WireLimits(max_message_bytes=32 << 20)
    for key in ("v", "actor", "seq", "episodes", "fields", "sent_at_ns"):
        data = b"\x81" + msgpack.packb(key) + tree
        t0 = time.perf_counter()
        assert parse_reason(cartpole_spec, data, limits) in ("bad_version", "bad_header", "bad_field"), key
        assert time.perf_counter() - t0 < 0.05, key  # a few microseconds in fact; msgpack took about a second


def test_weights_round_trip():
    tensors = {"a.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1, 2], np.int64)}
    info = {"env_id": "CartPole-v1", "spec": {"x": 1}}
    msg = wire.decode_weights(wire.encode_weights(5, tensors, info, incarnation=77), 1 << 20)
    assert msg.version == 5 and msg.incarnation == 77 and msg.run_info == info
    for k, v in tensors.items():
        np.testing.assert_array_equal(msg.tensors[k], v)
        assert msg.tensors[k].flags.writeable
    with pytest.raises(wire.Rejected):
        wire.decode_weights(wire.encode_weights(5, tensors, info, incarnation=77), 10)
    bad = msgpack.packb(
        {
            "v": 2,
            "type": "weights",
            "version": 1,
            "incarnation": 1,
            "run": {},
            "tensors": {"x": {"dtype": "|O", "shape": [1], "data": b"12345678"}},
        }
    )
    with pytest.raises(wire.Rejected):
        wire.decode_weights(bad, 1 << 20)


def test_weights_header_without_decoding_tensors():
    data = wire.encode_weights(42, {"w": np.zeros((1000, 100), np.float32)}, {"env_id": "x"}, incarnation=9)
    assert wire.weights_header(data) == (42, 9)
    assert wire.weights_header(b"\x00garbage") is None
    assert wire.weights_header(msgpack.packb({"v": 2, "version": "7", "incarnation": 1})) is None
    assert wire.weights_header(msgpack.packb({"v": 2, "version": 7})) is None  # no incarnation: not a v2 message


def test_contradicting_fields_are_rejected(cartpole_spec):
    """A step cannot be both terminal and cut by a time limit, and only a cut step carries a truncation value."""
    decoder = TrajectoryDecoder(cartpole_spec)

    def verdict(mutate):
        arrays = random_arrays(cartpole_spec, 2, seed=5)
        arrays["terminated"][:] = 0
        arrays["truncated"][:] = 0
        arrays["truncation_value"][:] = 0
        mutate(arrays)
        data = wire.encode_trajectories(
            cartpole_spec, actor_id="a", seq=0, policy_version=0, incarnation=1, arrays=arrays
        )
        try:
            decode_all(decoder, data)
        except wire.Rejected as e:
            return e.reason
        return "accepted"

    def cut(a, value):
        a["truncated"][1, 2] = 1
        a["truncation_value"][1, 2] = value

    assert verdict(lambda a: cut(a, 3.5)) == "accepted"
    assert verdict(lambda a: cut(a, 0.0)) == "accepted"
    assert verdict(lambda a: (cut(a, 3.5), a["terminated"].__setitem__((1, 2), 1))) == "inconsistent"
    assert verdict(lambda a: a["truncation_value"].__setitem__((0, 4), 1e-3)) == "inconsistent"
    assert verdict(lambda a: (cut(a, 1.0), a["truncation_value"].__setitem__((1, 3), -2.0))) == "inconsistent"
