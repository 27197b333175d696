"""A learner's configuration in layers (defaults < preset < resumed checkpoint < --config file < flags), resolved once
and frozen, written to LOGDIR/config.json with the layer of each value; --help grouped by section. In process and
socket-free, but for one end-to-end run of the real CLI."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from procutil import cli as run_cli
from procutil import finish, tail

from impala_async import cli
from impala_async.config import INDEX, Layered, LearnerConfig, layers, presets
from impala_async.config.resolve import Probe, resolve
from impala_async.learner import checkpoint


def configured(argv: list[str]):
    """What `impala-async ARGV` would run with: (Layered, resumed checkpoint state)."""
    return cli.load_learner_config(cli.build_parser().parse_args(argv))


def fake_checkpoint(monkeypatch, tmp_path, **values):
    saved = dict(LearnerConfig().flat(), **values)
    found = ({"config": saved}, tmp_path / "checkpoint.pt")
    monkeypatch.setattr(checkpoint.files, "load_latest", lambda *a, **k: found)


def test_an_abbreviated_flag_wins_over_the_checkpoint(monkeypatch, tmp_path):
    """The bug: argparse accepts --total-env for --total-env-steps, but explicit flags were found by matching argv
    strings against the full names, so the checkpoint's value silently won. The parse itself now says what was typed
    (every config flag's default is SUPPRESS)."""
    fake_checkpoint(monkeypatch, tmp_path, total_env_steps=1_000_000, batch_size=7)
    layered, _ = configured(["train", "--resume", str(tmp_path), "--total-env", "2000000"])
    assert layered.cfg.run.total_env_steps == 2_000_000 and layered.layer("total_env_steps") == "flag"
    assert layered.cfg.loss.batch_size == 7 and layered.layer("batch_size") == "resumed"
    assert layered.cfg.run.logdir == str(tmp_path) and layered.layer("logdir") == "command"


def test_a_resume_resolves_again_what_resolution_filled(monkeypatch, tmp_path):
    """The number of local actors (one per core but one) and the like are facts of the machine: a checkpoint keeps
    them with their layer, and a resume on another machine resolves them again instead of taking them."""
    saved = dict(LearnerConfig().flat(), num_actors=63, batch_size=7)
    state = {"config": saved, "config_layers": {"num_actors": "resolved", "batch_size": "flag"}}
    monkeypatch.setattr(checkpoint.files, "load_latest", lambda *a, **k: (state, tmp_path / "checkpoint.pt"))
    layered, _ = configured(["train", "--resume", str(tmp_path)])
    assert layered.cfg.actors.num_actors == -1 and layered.cfg.loss.batch_size == 7


def test_a_file_and_the_flags_typed_beside_it(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('env = "MinAtar/Breakout-v1"\nbatch-size = 8\n[ring]\nring_batches = 16\nwhen_full = "wait"\n')
    layered, _ = configured(["train", "--config", str(path), "--batch-size", "4"])
    cfg = layered.cfg
    assert (cfg.env.env, cfg.loss.batch_size, cfg.ring.ring_batches, cfg.ring.when_full) == (
        "MinAtar/Breakout-v1",
        4,
        16,
        "wait",
    )
    assert layered.layer("batch_size") == "flag" and layered.layer("ring_batches") == f"file:{path}"
    assert layered.layer("learning_rate") == "preset:minatar" and layered.layer("discount") == "default"
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text("loss:\n  entropy_cost: 0.02\nseed: 3\n")
    cfg = configured(["learner", "--config", str(yaml_path)])[0].cfg
    assert (cfg.loss.entropy_cost, cfg.run.seed, cfg.actors.num_actors) == (0.02, 3, 0)  # learner: no local actors


@pytest.mark.parametrize(
    "text,error",
    [
        ("batch_sise = 8\n", "no configuration field 'batch_sise'"),
        ('batch_size = "8"\n', "batch_size must be an integer"),
        ("[loss]\nring_batches = 4\n", "ring_batches belongs to section [ring], not [loss]"),
        ("batch_size = 0\n", "batch_size must be >= 1"),
        ("entropy_schedule_env_steps = -1\n", "entropy_schedule_env_steps must be >= 0"),
        ("batch_size = \n", "not valid TOML"),
    ],
)
def test_a_bad_file_is_refused_in_one_line_naming_the_field(tmp_path, text, error):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as e:
        configured(["train", "--config", str(path)])
    assert error in str(e.value) and "\n" not in str(e.value), e.value


def test_presets_sit_between_the_defaults_and_the_file(tmp_path):
    """Each family's preset applies to its ids, every value it sets is labelled with it, and a flag or a file wins."""
    assert presets.family("MinAtar/Breakout-v1") == "minatar" and presets.family("ALE/Pong-v5") == "atari"
    assert presets.family("PongNoFrameskip-v4") == "atari" and presets.family("CartPole-v1") == "classic"
    layered, _ = configured(["train", "--env", "MinAtar/Breakout-v1", "--entropy-cost", "0.01"])
    assert layered.cfg.loss.batch_size == 8 and layered.layer("batch_size") == "preset:minatar"
    assert layered.cfg.loss.reward_scale == 1.0 and layered.layer("reward_scale") == "preset:minatar"
    assert layered.cfg.loss.updates_per_batch == 2 and layered.layer("updates_per_batch") == "preset:minatar"
    assert layered.cfg.loss.entropy_cost == 0.01 and layered.layer("entropy_cost") == "flag"
    assert re.search(r"loss.batch_size = 8 +\(preset:minatar\)", layered.describe())
    pong, _ = configured(["train", "--env", "ALE/Pong-v5", "--learning-rate", "3e-4"])
    assert (pong.cfg.loss.reward_clip, pong.cfg.loss.entropy_cost) == (1.0, 0.01)
    assert pong.layer("reward_clip") == "preset:atari" and pong.cfg.loss.learning_rate == 3e-4
    for family, values in presets.PRESETS.items():  # every value a preset sets is one the flags could
        layered = configured(["train", "--preset", family])[0]
        assert all(layered.layer(name) == f"preset:{family}" for name in values), family
    cartpole = configured(["train"])[0]
    assert cartpole.cfg.loss.batch_size == 16 and cartpole.cfg.loss.reward_scale == 0.1  # classic: the defaults
    assert configured(["train", "--env", "MinAtar/Breakout-v1", "--preset", "none"])[0].cfg.loss.batch_size == 16
    assert configured(["train", "--preset", "minatar"])[0].cfg.loss.batch_size == 8  # by hand, on CartPole
    path = tmp_path / "run.toml"
    path.write_text('env = "MinAtar/Asterix-v1"\nbatch_size = 32\n')
    assert configured(["train", "--config", str(path)])[0].cfg.loss.batch_size == 32  # the file is above the preset


def test_a_resolved_config_is_frozen_and_resolution_fills_only_what_was_left_to_it():
    cfg = LearnerConfig.of(batch_size=4, listen="tcp://127.0.0.1:7000")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.loss.batch_size = 5
    layered = resolve(
        Layered(cfg, {"batch_size": "flag", "listen": "flag"}),
        default_listen="tcp://127.0.0.1:*",
        probe=Probe(image_max=1.0, trajectory_nbytes=1 << 20),
        now=0,
    )
    got = layered.cfg
    assert got.network.publish == "tcp://127.0.0.1:7001" and layered.layer("publish") == "resolved"
    assert got.network.listen == "tcp://127.0.0.1:7000" and layered.layer("listen") == "flag"
    assert got.run.logdir == "runs/CartPole-v1-19700101-000000"
    assert got.model.input_scale == 1.0  # 0/1 planes: no scaling
    assert got.limits.max_trajectories_per_message == 64  # 64 MiB of 1 MiB trajectories
    assert got.limits.max_unread_bytes_per_connection == 10 * got.limits.max_message_bytes
    assert got.actors.num_actors >= 1 and layered.layer("num_actors") == "resolved"
    # The ring holds the batch in training (4), pace's backlog (one message: the largest accepted, 64, above the
    # local actors' 32 and 2 batches of 4) and two more such messages arriving: 196 trajectories, 49 batches of 4.
    assert got.ring.ring_batches == 49 and layered.layer("ring_batches") == "resolved"
    given = Layered(cfg.replace(ring_batches=5), {"ring_batches": "flag"})
    given = resolve(given, default_listen="tcp://127.0.0.1:*", probe=Probe(None, 1))
    assert given.cfg.ring.ring_batches == 5 and given.layer("ring_batches") == "flag"
    again = resolve(layered, default_listen="tcp://127.0.0.1:*", probe=Probe(None, 1 << 20))
    assert again.cfg == got  # nothing left to resolve


def test_every_field_has_one_flag_name_and_the_help_is_grouped_by_section():
    text = cli.build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    headings = [
        "run [run]",
        "environment [env]",
        "model [model]",
        "loss and optimiser [loss]",
        "ring and flow control [ring]",
        "network [network]",
        "limits [limits]",
        "checkpoints [checkpoints]",
        "observability [observe]",
        "actors [actors]",
        "learner ranks [ranks]",
    ]
    positions = [text.index(h + ":") for h in headings]
    assert positions == sorted(positions), positions
    for name in INDEX:
        assert f"--{name.replace('_', '-')} " in text, name
    assert "--actor-device" in text and "--actor-codec" in text  # an actor's options under the learner's names
    actor_help = cli.build_parser()._subparsers._group_actions[0].choices["actor"].format_help()
    assert "--device STR" in actor_help and "--envs-per-actor INT" in actor_help


@pytest.mark.process
def test_the_run_writes_its_config_and_a_second_run_replays_it(tmp_path):
    """End to end: a real (tiny) run writes LOGDIR/config.json with each value's layer; --config of that file runs
    with the same chosen values (not its logdir, not what resolution filled)."""
    path = tmp_path / "run.toml"
    path.write_text("unroll_length = 10\n[loss]\nbatch_size = 4\n")
    first, second = tmp_path / "first", tmp_path / "second"
    log = tmp_path / "log"
    proc = run_cli(
        "train",
        "--config",
        str(path),
        "--batch-size",
        "2",
        "--num-actors",
        "1",
        "--envs-per-actor",
        "2",
        "--total-env-steps",
        "400",
        "--logdir",
        str(first),
        log=log,
    )
    finish(proc, log, 120)
    text = log.read_text()
    assert "loss.batch_size = 2" in text and "(flag)" in text and f"(file:{path})" in text, tail(log)
    saved = json.loads((first / "config.json").read_text())
    assert saved["config"]["loss"]["batch_size"] == 2 and saved["layers"]["batch_size"] == "flag"
    assert saved["config"]["env"]["unroll_length"] == 10 and saved["layers"]["unroll_length"] == f"file:{path}"
    assert saved["layers"]["publish"] == "resolved" and "learning_rate" not in saved["layers"]
    replay, _ = configured(["train", "--config", str(first / "config.json"), "--logdir", str(second)])
    assert (replay.cfg.loss.batch_size, replay.cfg.env.unroll_length, replay.cfg.run.total_env_steps) == (2, 10, 400)
    assert replay.cfg.network.publish == "" and replay.cfg.run.logdir == str(second)  # resolved again, not replayed
    state, _ = checkpoint.load_latest(first)
    assert state["config"]["batch_size"] == 2 and state["config_layers"]["batch_size"] == "flag"


def test_a_run_config_json_reads_back_as_it_was_written(tmp_path):
    layered = layers.load(flags={"batch_size": 3}, command={"num_actors": 0})
    path = layered.write(tmp_path, "learner")
    data = json.loads(path.read_text())
    assert data["command"] == "learner" and data["layers"] == {"batch_size": "flag", "num_actors": "command"}
    assert layers.read_file(str(path)) == {"batch_size": 3}  # a command's own values are its own again


def test_actor_options_come_from_one_source():
    """train's local actors, impala-async actor and its supervisor read one ActorOptions: the same defaults, and a
    child's command line (actor_argv) parses back into exactly the options it was written from."""
    from impala_async.actors.procs import actor_argv
    from impala_async.config import ActorOptions

    assert LearnerConfig().actors.options() == ActorOptions()
    parsed = cli.build_parser().parse_args(["actor", "--learner", "tcp://127.0.0.1:5555"])
    assert cli._section(ActorOptions, parsed) == ActorOptions()
    options = dataclasses.replace(
        LearnerConfig.of(
            actor_device="cuda:1", envs_per_actor=3, actor_codec="none", heartbeat_timeout_s=7.5
        ).actors.options()
    )
    argv = actor_argv("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556", 2, 9, 1, seed=4, options=options)
    args = cli.build_parser().parse_args(argv[argv.index("actor") :])
    assert cli._section(ActorOptions, args) == options
    assert (args.index, args.seed, args.heartbeat_fd, args.metrics_port) == (2, 4, 9, 0)
