"""Configuration input gets the treatment wire input has (issue 27, row 4): files bounded before they are parsed (size,
nesting, YAML aliases), every float finite and the learning rate in range, sizes weighed against the machine's memory
before anything is allocated; each refusal one line naming the field and where it came from.

The files are real files; the last test drives the real CLI (`train --config FILE`) as a user would."""

from __future__ import annotations

import time

import pytest
from procutil import run_cli

from impala_async.config import LearnerConfig, layers
from impala_async.core.spec import TrajectorySpec
from impala_async.learner.budget import memory_refusal


def alias_bomb() -> str:
    """456 bytes of YAML whose aliases expand to 9^10 values (the billion laughs)."""
    text = 'a: &a ["x","x","x","x","x","x","x","x","x"]\n'
    for name, prev in zip("bcdefghij", "abcdefghi", strict=True):
        text += f"{name}: &{name} [{','.join([f'*{prev}'] * 9)}]\n"
    return text + "batch_size: *j\n"


FILES = {
    "alias_bomb.yaml": (alias_bomb(), "anchors and aliases"),
    "deep.toml": ("batch_size = " + "[" * 5000 + "]" * 5000 + "\n", "nested more than 32 deep"),
    "deep.yaml": ("batch_size: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than 32 deep"),
    "deep.json": ('{"batch_size": ' + "[" * 5000 + "]" * 5000 + "}\n", "nested more than 32 deep"),
    "deep_block.yaml": ("".join("  " * i + f"k{i}:\n" for i in range(990)), "nested too deeply"),
    "huge.toml": ("# " + "x" * (2 << 20) + "\n", "larger than 1,048,576 bytes"),
    "timeout_inf.toml": ("[network]\nhandshake_timeout_s = inf\n", "handshake_timeout_s must be a finite number"),
    "lr_inf.yaml": ("learning_rate: .inf\n", "learning_rate must be a finite number"),
    "lr_huge.toml": ("learning_rate = 1e300\n", "learning_rate must lie in (0, 1]"),
    "nan.toml": ("reward_scale = nan\n", "reward_scale must be a finite number"),
    "huge_value.json": ('{"batch_size": "' + "9" * 5000 + '"}\n', "batch_size must be an integer"),
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_bad_file_is_refused_in_one_short_line_naming_it(tmp_path, name):
    text, words = FILES[name]
    path = tmp_path / name
    path.write_text(text)
    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        layers.load(flags={}, file=str(path)).check()
    message = str(e.value)
    assert words in message and str(path) in message, message
    assert len(message) < 500 and "\n" not in message, f"{len(message)} characters"
    assert time.monotonic() - t0 < 10


def test_every_float_is_finite_and_a_typed_value_is_named_as_typed():
    for name in ("shutdown_timeout_s", "checkpoint_interval_s", "pace_window_s", "max_abs_reward", "reward_scale"):
        with pytest.raises(ValueError, match=f"{name} must be a finite number"):
            LearnerConfig.of(**{name: float("inf")}).check()
    with pytest.raises(ValueError, match=r"learning_rate must lie in \(0, 1\], got 2 \(typed\)"):
        layers.load(flags={"learning_rate": 2.0}).check()


def test_sizes_the_machine_cannot_hold_are_refused_before_allocation():
    spec = TrajectorySpec(obs_shape=(4,), obs_dtype="float32", num_actions=2, unroll_length=20)
    fits = LearnerConfig.of(ring_batches=8, max_trajectories_per_message=256, num_actors=1)
    assert memory_refusal(fits, spec, 1 << 30) == ""
    cases = {
        "hidden_sizes '100000,100000'": fits.replace(hidden_sizes="100000,100000"),
        "ring_batches 1000000000": fits.replace(ring_batches=10**9),
        "batch_size 100000000": fits.replace(batch_size=10**8),
        "max_trajectories_per_message 1000000000": fits.replace(max_trajectories_per_message=10**9),
    }
    for words, cfg in cases.items():
        refusal = memory_refusal(cfg, spec, 24 << 30)
        assert "more than the 24.0 GiB this machine allows" in refusal and words in refusal, refusal
    long = TrajectorySpec(obs_shape=(4,), obs_dtype="float32", num_actions=2, unroll_length=10**7)
    assert "unroll_length 10000000" in memory_refusal(fits.replace(unroll_length=10**7), long, 24 << 30)


@pytest.mark.process
@pytest.mark.parametrize(
    "args,words",
    [
        (["--config", "alias_bomb.yaml"], "anchors and aliases"),
        (["--config", "timeout_inf.toml"], "handshake_timeout_s must be a finite number"),
        (["--hidden-sizes", "100000,100000"], "hidden_sizes '100000,100000'"),
        (
            ["--reproducible", "1", "--num-actors", "3", "--envs-per-actor", "5", "--batch-size", "4"],
            "--reproducible 1: num_actors x envs_per_actor (3 x 5 = 15) must be a multiple of batch_size 4",
        ),
    ],
)
def test_train_refuses_in_one_line(tmp_path, args, words):
    for name in ("alias_bomb.yaml", "timeout_inf.toml"):
        (tmp_path / name).write_text(FILES[name][0])
    out = run_cli("train", "--env", "CartPole-v1", "--logdir", "run", *args, timeout=120, cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("impala-async: ") and words in last and len(last) < 1000, last
    assert not (tmp_path / "run").exists(), "refused before anything was written"
