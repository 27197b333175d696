"""The EnvPool backend (actors/vec.py, ``--env-backend envpool``): its options, and its frames against the protocol.

``envpool_settings`` is checked without EnvPool. The rest needs the envpool extra (skipped, with the reason, without
it) and the atari extra (the reference below drives ale-py).

What can be compared byte for byte: EnvPool seeds an environment's ALE with its seed (``random_seed``, the sticky
draws) and draws its no-op count from its own generator. ``Pinned`` is tests/test_atari_doc.py's ``DocAtari`` (the
protocol document's preprocessing on a bare ``ale_py.ALEInterface``) with the ALE seeded the same way, and both sides
make exactly one no-op at every reset (``noop_max=1`` for EnvPool, the only option changed). Then every observation
(the reset's included, after game overs and after time limits), reward, terminated/truncated flag, episode record and
truncation final observation must be equal. The no-op count itself is checked apart, from the emulator RAM at reset:
1 to 30, never 0. One more difference stays out of reach of the comparison because the actor never sends it: the final
observation of a game over (BENCHMARKS.md, EnvPool).

The comparison can fail: ``test_a_wrong_option_does_not_match`` changes one EnvPool option at a time back to its
EnvPool default (FIRE at reset, no sticky actions) or away from ours (bilinear resize) and asserts that each is caught.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from procutil import TINY_PONG, cli, finish, read_metrics, tail

from impala_async.actors.vec import ATARI_FRAME_CAP, envpool_settings, make_vec, resolve_backend


def test_envpool_settings_are_make_envs_preprocessing():
    task, options = envpool_settings("ALE/Pong-v5", {})
    assert task == "Pong-v5"
    assert options == dict(
        stack_num=4,
        frame_skip=4,
        noop_max=30,
        img_height=84,
        img_width=84,
        gray_scale=True,
        use_inter_area_resize=True,
        use_fire_reset=False,
        episodic_life=False,
        zero_discount_on_life_loss=False,
        reward_clip=False,
        repeat_action_probability=0.25,
        max_episode_steps=ATARI_FRAME_CAP // 4,
    )
    task, options = envpool_settings("MontezumaRevengeNoFrameskip-v4", {"full_action_space": True})
    assert task == "MontezumaRevenge-v5" and options["repeat_action_probability"] == 0.0
    assert options["full_action_space"] is True
    # Frame caps (emulator frames, no-ops included, in make_env) become agent steps, rounded up.
    assert envpool_settings("ALE/Pong-v5", {"max_num_frames_per_episode": 101})[1]["max_episode_steps"] == 26
    assert (
        envpool_settings("ALE/Pong-v5", {"max_episode_steps": 400, "max_num_frames_per_episode": 1000})[1][
            "max_episode_steps"
        ]
        == 100
    )
    assert envpool_settings("ALE/Pong-v5", {"max_num_frames_per_episode": 0})[1]["max_episode_steps"] == 2**31 - 1
    assert envpool_settings("ALE/Pong-v5", {"repeat_action_probability": 0})[1]["repeat_action_probability"] == 0
    with pytest.raises(ValueError, match="obs_type"):
        envpool_settings("ALE/Pong-v5", {"obs_type": "rgb"})
    with pytest.raises(ValueError, match="ALE/<Game>-v5"):
        envpool_settings("Pong-v4", {})


def test_only_atari_ids_go_to_envpool():
    assert resolve_backend("ALE/Pong-v5", "envpool") == "envpool"
    assert resolve_backend("PongNoFrameskip-v4", "envpool") == "envpool"
    for env_id in ("MinAtar/Breakout-v1", "CartPole-v1", "impala_async.actors.envs:PongLike-v0"):
        assert resolve_backend(env_id, "envpool") == "gymnasium"
    assert resolve_backend("ALE/Pong-v5", "gymnasium") == "gymnasium"
    with pytest.raises(ValueError, match="auto, gymnasium, envpool"):
        resolve_backend("ALE/Pong-v5", "jax")
    vec = make_vec("CartPole-v1", {}, 2, "envpool")  # no EnvPool needed: CartPole stays on gymnasium
    assert vec.backend == "gymnasium"
    vec.close()


def test_auto_is_envpool_for_atari_where_installed(monkeypatch):
    """The default backend, auto: EnvPool for Atari ids when its package is importable, gymnasium otherwise (and for
    every other id), so that a core install gives no warning and the envpool extra is used once installed."""
    import importlib.util

    from impala_async.config import DEFAULT_ENV_BACKEND, LearnerConfig

    assert DEFAULT_ENV_BACKEND == "auto" and LearnerConfig().env.env_backend == "auto"
    installed = importlib.util.find_spec("envpool") is not None
    assert resolve_backend("ALE/Pong-v5", "auto") == ("envpool" if installed else "gymnasium")
    assert resolve_backend("MinAtar/Breakout-v1", "auto") == "gymnasium"
    assert resolve_backend("CartPole-v1", "auto") == "gymnasium"
    monkeypatch.setitem(sys.modules, "envpool", None)  # what find_spec reports for a package that is absent
    assert resolve_backend("ALE/Pong-v5", "auto") == "gymnasium"
    assert resolve_backend("ALE/Pong-v5", "envpool") == "envpool"  # asked by name: make_vec says what to install


def block_envpool(monkeypatch) -> None:
    """``import envpool`` fails from here on in this test, as where the extra is not installed."""
    import builtins

    real = builtins.__import__

    def no_envpool(name, *args, **kwargs):
        if name == "envpool":
            raise ImportError("No module named 'envpool'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_envpool)


def test_a_missing_extra_names_the_pip_install(monkeypatch):
    import gymnasium as gym

    block_envpool(monkeypatch)
    with pytest.raises(gym.error.DependencyNotInstalled, match=r"pip install 'impala-async\[envpool\]'"):
        make_vec("ALE/Pong-v5", {}, 1, "envpool")


def test_an_actor_follows_the_learner_or_its_own_flag(monkeypatch, caplog):
    """run.env_backend is informational: without EnvPool the actor falls back to gymnasium, with a warning; its own
    --env-backend envpool is a demand, refused (None, logged) without EnvPool."""
    pytest.importorskip("ale_py", reason="the fallback builds ALE environments: the atari extra")
    from impala_async.actors import actor, runs

    block_envpool(monkeypatch)
    run_info = {"env_id": "ALE/Pong-v5", "env_backend": "envpool"}
    cfg = actor.ActorConfig(learner="tcp://127.0.0.1:1", weights="tcp://127.0.0.1:2")
    envs = runs._make_envs(cfg, run_info, 1, "uint8", [0])
    assert envs is not None and envs.backend == "gymnasium"
    envs.close()
    assert "pip install 'impala-async[envpool]'" in caplog.text and "using gymnasium" in caplog.text
    envs = runs._make_envs(cfg, dict(run_info, env_backend="warp-drive"), 1, "uint8", [0])
    assert envs.backend == "gymnasium" and "unknown env backend 'warp-drive'" in caplog.text
    envs.close()
    cfg = actor.ActorConfig(learner="tcp://127.0.0.1:1", weights="tcp://127.0.0.1:2", env_backend="envpool")
    assert runs._make_envs(cfg, run_info, 1, "uint8", [0]) is None


envpool = pytest.importorskip("envpool", reason="needs the envpool extra: pip install 'impala-async[envpool]'")
ale_py = pytest.importorskip("ale_py", reason="the reference needs the atari extra")
pytest.importorskip("cv2", reason="the reference needs the atari extra")

from ale_py import roms  # noqa: E402
from doc_atari import DocAtari  # noqa: E402

from impala_async.actors.vec import EnvPoolEnvs  # noqa: E402


class OneNoop:
    def integers(self, low, high):
        return 1


class Pinned(DocAtari):
    """The doc's environment seeded as EnvPool seeds one (the ALE's random_seed is the seed), one no-op a reset."""

    def __init__(self, game: str, sticky: float, seed: int):
        super().__init__(game, sticky)
        self.ale.setInt("random_seed", seed)
        self.ale.loadROM(roms.get_rom_path(game))
        self.action_set = self.ale.getMinimalActionSet()
        self.rng = OneNoop()


CASES = {  # id: (env_id, game, env_kwargs, the doc's sticky-action probability for the id, agent steps)
    "pong_v5_cap": ("ALE/Pong-v5", "pong", {"max_num_frames_per_episode": 800}, 0.25, 450),  # cut at 200 and 400
    "pong_v4": ("PongNoFrameskip-v4", "pong", {}, 0.0, 150),
    "breakout_v5": ("ALE/Breakout-v5", "breakout", {}, 0.25, 400),  # game overs
}
SEEDS = (11, 12)


def compare(case: str, **options) -> tuple[str | None, dict]:
    """Both sides through the case's fixed actions, 2 environments; (first difference or None, what happened)."""
    env_id, game, kwargs, sticky, steps = CASES[case]
    vec = EnvPoolEnvs(env_id, kwargs, len(SEEDS), seeds=SEEDS, noop_max=1, **options)
    cap = vec.options["max_episode_steps"]
    docs = [Pinned(game, sticky, s) for s in SEEDS]
    seen = {"terminated": 0, "truncated": 0, "rewards": 0}
    try:
        obs = vec.reset(SEEDS)
        for k, doc in enumerate(docs):
            if not np.array_equal(obs[k], doc.reset()):
                return f"env {k}: the first observation", seen
        K, lengths, returns, episodes = len(SEEDS), [0] * len(SEEDS), [0.0] * len(SEEDS), []
        reward, terminated, truncated = np.zeros(K, np.float32), np.zeros(K, np.uint8), np.zeros(K, np.uint8)
        actions = np.random.default_rng(0).integers(0, vec.single_action_space.n, (steps, K))
        for t in range(steps):
            ended, cut = vec.step(actions[t], reward, terminated, truncated)
            cut = dict(cut)
            for k, doc in enumerate(docs):
                mine, my_reward, my_terminated, _ = doc.step(int(actions[t, k]))
                lengths[k] += 1
                returns[k] += my_reward
                my_truncated = lengths[k] >= cap and not my_terminated  # EnvPool's cap, in agent steps
                theirs = (float(reward[k]), bool(terminated[k]), bool(truncated[k]))
                if theirs != (my_reward, my_terminated, my_truncated):
                    return f"env {k} step {t}: (reward, terminated, truncated) {theirs}", seen
                seen["rewards"] += my_reward != 0
                if (k in ended) != (my_terminated or my_truncated):
                    return f"env {k} step {t}: ended", seen
                if my_truncated and not np.array_equal(cut.get(k), mine):
                    return f"env {k} step {t}: the final observation of a time limit", seen
                if my_terminated or my_truncated:
                    seen["terminated" if my_terminated else "truncated"] += 1
                    episodes.append((returns[k], lengths[k]))
                    lengths[k], returns[k] = 0, 0.0
                    mine = doc.reset()
                if not np.array_equal(vec.obs[k], mine):
                    return f"env {k} step {t}: observation ({int((vec.obs[k] != mine).sum())} bytes)", seen
        if vec.pop_episodes() != episodes:
            return "episode records", seen
        return None, seen
    finally:
        vec.close()


@pytest.mark.parametrize("case", list(CASES))
def test_envpool_reproduces_the_doc(case):
    difference, seen = compare(case)
    assert difference is None, f"{case}: EnvPool's preprocessing differs from the doc's at {difference}"
    if case == "pong_v5_cap":
        assert seen["truncated"] == 4 and seen["terminated"] == 0 and seen["rewards"] > 0
    elif case == "breakout_v5":
        assert seen["terminated"] >= 1


@pytest.mark.parametrize(
    "case, option",
    [
        ("breakout_v5", {"use_fire_reset": True}),
        ("pong_v5_cap", {"repeat_action_probability": 0.0}),
        ("pong_v4", {"use_inter_area_resize": False}),
    ],
)
def test_a_wrong_option_does_not_match(case, option):
    difference, _ = compare(case, **option)
    assert difference is not None, f"{option} should not reproduce the doc"


def test_no_op_starts_are_1_to_30():
    """The no-op count of each reset, read back from the emulator RAM (each count of Pong gives another RAM)."""
    ale = ale_py.ALEInterface()
    ale.setFloat("repeat_action_probability", 0.0)
    ale.loadROM(roms.get_rom_path("pong"))
    ale.reset_game()
    count_of = {}
    for n in range(0, 31):
        count_of[ale.getRAM().tobytes()] = n
        ale.act(ale.getMinimalActionSet()[0])
    assert len(count_of) == 31
    vec = EnvPoolEnvs("PongNoFrameskip-v4", {}, 16, seeds=range(16))
    try:
        counts = []
        for _ in range(8):
            _, info = vec.pool.reset()
            counts += [count_of.get(ram.tobytes()) for ram in info["ram"]]
    finally:
        vec.close()
    assert None not in counts and min(counts) >= 1 and max(counts) <= 30, sorted(set(counts))
    # 128 draws, uniform on 1..30: about 29.6 distinct values expected, the mean within 0.8 of 15.5 (one sigma)
    assert len(set(counts)) >= 25 and abs(np.mean(counts) - 15.5) < 3, (np.mean(counts), sorted(set(counts)))


def test_the_vector_contract():
    """Spaces, dtype and stacking as make_env's; a reset is no step; episodes counted in agent steps."""
    vec = make_vec("ALE/Pong-v5", {"max_num_frames_per_episode": 40}, 3, "envpool", "uint8", seeds=(1, 2, 3))
    try:
        assert vec.backend == "envpool" and vec.frame_stack == 4
        assert vec.single_observation_space.shape == (4, 84, 84) and vec.single_action_space.n == 6
        obs = vec.reset((1, 2, 3))
        assert obs.dtype == np.uint8 and obs.shape == (3, 4, 84, 84)
        assert (obs[:, :3] == obs[:, 3:]).all(), "a new episode's stack repeats its first frame"
        r, te, tr = np.zeros(3, np.float32), np.zeros(3, np.uint8), np.zeros(3, np.uint8)
        for t in range(1, 31):
            previous = vec.obs.copy()
            ended, cut = vec.step(np.zeros(3, np.int64), r, te, tr)
            if t % 10:  # a continuing stack is the previous one shifted by one frame
                assert not ended and (vec.obs[:, :3] == previous[:, 1:]).all()
            else:  # 40 frames: 10 agent steps, then a reset in the same call
                assert ended == [0, 1, 2] and tr.all() and not te.any() and [k for k, _ in cut] == [0, 1, 2]
                assert (vec.obs[:, :3] == vec.obs[:, 3:]).all()
        assert vec.pop_episodes() == [(0.0, 10)] * 9 and vec.pop_episodes() == []
    finally:
        vec.close()


@pytest.mark.process
def test_train_pong_with_envpool_end_to_end(tmp_path):
    """`impala-async train --env ALE/Pong-v5 --env-backend envpool` on a tiny budget: the actors step EnvPool, send
    single frames, and the learner accepts every trajectory."""
    logdir, log = tmp_path / "run", tmp_path / "log"
    proc = cli(
        "train", *TINY_PONG, "--env-backend", "envpool", "--envs-per-actor", "4", "--logdir", str(logdir), log=log
    )
    finish(proc, log, 180)
    text = log.read_text()
    assert "x ALE/Pong-v5 (envpool, cpu)" in text, tail(log)
    last = read_metrics(logdir)[-1]
    assert last["env_steps_trained"] >= 400 and last["trajectories_rejected"] == 0
    assert last["learner_steps"] >= 10 and np.isfinite(last["grad_norm"])
    import torch

    from impala_async.learner import checkpoint

    state = torch.load(checkpoint.list_checkpoints(logdir)[-1], weights_only=True)
    assert state["spec"]["frame_stack"] == 4, "frames should travel one at a time (--frame-dedup 1)"
