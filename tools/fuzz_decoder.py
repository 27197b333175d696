#!/usr/bin/env python3
"""Coverage-guided fuzzing of the trajectory decoder (core.decoder.TrajectoryDecoder) with atheris (libFuzzer).

Not a test: run it by hand for as long as you like. Needs ``pip install atheris`` (wheels for CPython 3.11 on x86-64
Linux). Each input is either raw message bytes (libFuzzer's own mutations of a seed corpus of valid messages) or, when
its first byte is odd, a recipe for structural changes to a valid message (keys and values replaced, payloads
re-encoded), read with atheris.FuzzedDataProvider. The property is the one of tests/test_fuzz.py: ``parse`` and
``decode_into`` succeed or raise ``wire.Rejected``, and what they accept holds only values the spec allows. Anything
else is a crash: libFuzzer stops and writes the input to ``crash-*`` (replay it with ``--replay FILE``).

    python tools/fuzz_decoder.py --seconds 60
    python tools/fuzz_decoder.py --seconds 600 --spec image --corpus /tmp/decoder-corpus
    python tools/fuzz_decoder.py --replay crash-0123abcd
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["impala_async", "msgpack"]):
    import msgpack
    import numpy as np

    from impala_async.core import wire
    from impala_async.core.decoder import TrajectoryDecoder
    from impala_async.core.spec import TrajectorySpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import FUZZ_LIMITS as LIMITS  # noqa: E402  (the same specs, limits and checks as tests/test_fuzz.py)
from helpers import FUZZ_SPECS as SPECS  # noqa: E402
from helpers import assert_values_allowed, random_arrays  # noqa: E402

KEYS = [
    "v",
    "type",
    "actor",
    "seq",
    "policy_version",
    "incarnation",
    "n",
    "episodes",
    "fields",
    "sent_at_ns",
    "dtype",
    "shape",
    "codec",
    "data",
    "obs",
    "action",
    "reward",
    "terminated",
    "truncated",
    "truncation_value",
    "behaviour_logits",
]


def seed_messages(spec: TrajectorySpec) -> list[bytes]:
    return [
        wire.encode_trajectories(
            spec,
            actor_id=f"fuzz/{i}",
            seq=i,
            policy_version=1,
            incarnation=7,
            arrays=random_arrays(spec, n, seed=i),
            episodes=[(1.5, 3)] * (i % 2),
            codec=codec,
            sent_at_ns=10**18 if i % 2 else None,
        )
        for i, (n, codec) in enumerate((n, c) for n in (1, 2, 3) for c in wire.CODECS)
    ]


def has_bin_key(obj) -> bool:
    if isinstance(obj, dict):
        return any(isinstance(k, bytes) or has_bin_key(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(has_bin_key(x) for x in obj)
    return False


def fuzzed_value(fdp: atheris.FuzzedDataProvider, depth: int = 0):
    kind = fdp.ConsumeIntInRange(0, 9 if depth < 2 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeIntInRange(-(1 << 63), (1 << 64) - 1)
    if kind == 3:
        return fdp.ConsumeRegularFloat() if fdp.ConsumeBool() else fdp.ConsumeFloat()
    if kind == 4:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 80))
    if kind == 5:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 600))
    if kind == 6:
        return fdp.PickValueInList(["<f4", "<i4", "|u1", "<f8", "lz4", "none", "jpeg", "trajectories", 1, 0, [], {}])
    if kind == 7:
        return msgpack.ExtType(fdp.ConsumeIntInRange(0, 127), fdp.ConsumeBytes(4))
    if kind == 8:
        return [fuzzed_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 5))]
    return {fuzzed_key(fdp): fuzzed_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 5))}


def fuzzed_key(fdp: atheris.FuzzedDataProvider):
    choice = fdp.ConsumeIntInRange(0, 3)
    if choice == 0:
        return fdp.ConsumeUnicodeNoSurrogates(12)
    if choice == 1:
        return fdp.ConsumeBytes(4)  # bin keys: found a crash once (sorted() on mixed keys), keep fuzzing them
    return fdp.PickValueInList(KEYS)


def structural(spec: TrajectorySpec, seeds: list[bytes], fdp: atheris.FuzzedDataProvider) -> bytes:
    msg = msgpack.unpackb(fdp.PickValueInList(seeds), raw=False)
    for _ in range(fdp.ConsumeIntInRange(1, 4)):
        where = fdp.ConsumeIntInRange(0, 2)
        target = msg if where == 0 else msg.get("fields")
        if where == 2 and isinstance(target, dict):
            target = target.get(fdp.PickValueInList([f.name for f in spec.fields]))
        if not isinstance(target, dict):
            continue
        op = fdp.ConsumeIntInRange(0, 2)
        if op == 0 and target:
            del target[fdp.PickValueInList(sorted(target, key=repr))]
        elif op == 1 and where == 2:
            target["data"] = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 2048))
        else:
            keys = sorted(target, key=repr)
            key = fdp.PickValueInList(keys) if keys and fdp.ConsumeBool() else fuzzed_key(fdp)
            target[key] = fuzzed_value(fdp)
    return msgpack.packb(msg, use_bin_type=True)


def check(spec: TrajectorySpec, decoder: TrajectoryDecoder, data: bytes) -> None:
    try:
        msg = decoder.parse(data)
        dest = {f.name: np.full((msg.n, *f.shape), 0xAB if f.dtype == np.uint8 else -7, f.dtype) for f in spec.fields}
        decoder.decode_into(msg, dest)
    except wire.Rejected:
        return
    assert 1 <= msg.n <= LIMITS.max_trajectories_per_message
    assert_values_allowed(spec, dest)


def main() -> int:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=int, default=60, help="how long to fuzz (default: 60)")
    p.add_argument("--spec", choices=sorted(SPECS), default="vector", help="trajectory spec (default: vector)")
    p.add_argument("--corpus", default="", help="corpus directory, kept between runs (default: a temporary one)")
    p.add_argument("--replay", default="", help="run one input file (e.g. a crash-* file) and exit")
    ARGS, rest = p.parse_known_args()
    spec = SPECS[ARGS.spec]
    decoder = TrajectoryDecoder(spec, LIMITS)
    seeds = seed_messages(spec)

    def one_input(data: bytes) -> None:
        if data[:1] and data[0] & 1:
            fdp = atheris.FuzzedDataProvider(data[1:])
            message = structural(spec, seeds, fdp)
        else:
            message = data[1:] if data[:1] else data
        check(spec, decoder, message)

    if ARGS.replay:
        one_input(Path(ARGS.replay).read_bytes())
        print("no crash")
        return 0
    corpus = Path(ARGS.corpus or tempfile.mkdtemp(prefix="decoder-corpus-"))
    corpus.mkdir(parents=True, exist_ok=True)
    for i, m in enumerate(seeds):
        (corpus / f"seed-{i}").write_bytes(b"\0" + m)  # even first byte: raw mode
    atheris.Setup([sys.argv[0], f"-max_total_time={ARGS.seconds}", "-max_len=8192", *rest, str(corpus)], one_input)
    atheris.Fuzz()
    return 0


ARGS: argparse.Namespace


if __name__ == "__main__":
    sys.exit(main())
