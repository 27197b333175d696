"""docs/protocol.md, "Atari ids: the preprocessing an actor must apply", reimplemented from the text alone.

``DocAtari`` (tests/doc_atari.py) drives a bare ``ale_py.ALEInterface`` (no gymnasium, none of its Atari wrappers)
and does the frame repeat, reward sum, greyscale, max-pool, resize and stacking in its own numpy/OpenCV code, as the
doc words them. The tests compare it with ``impala_async.actors.envs.make_env`` step by step: every observation
byte, every reward, and terminated/truncated, over a few hundred steps of a fixed action sequence with resets, in
Pong (v5 with sticky actions, v4 without), in Pong with a tiny frame cap (so that truncation falls on every one of
the 4 frames of a step), and in Breakout (lost lives that do not end the episode, and game overs).

What is pinned, and why: the no-op count and the sticky-action draws are random. Both sides are reset once with the
same seed, from which the doc derives both random streams (numpy's generator for the no-op count, the ALE's own for
sticky actions); later resets are unseeded on both sides, so both streams continue. The reimplementation therefore
draws the same no-op counts and makes the same emulator calls, hence the same sticky draws, as ``make_env`` does; the
no-op count ``make_env`` used is visible in its reset info (``episode_frame_number``) and is checked against ours.

The comparison can fail: ``test_a_wrong_reading_does_not_match`` runs the same comparison with one detail of the doc
changed at a time (resize before the max-pool, greyscale with the channels swapped, no max-pool, the true final
screens at an episode end, no-ops counted in agent steps) and asserts that each is caught.
"""

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("ale_py")
pytest.importorskip("cv2")

from doc_atari import WRONG, DocAtari  # noqa: E402

from impala_async.actors.envs import make_env  # noqa: E402

SEED = 7
CASES = {  # id: (env_id, game, env_kwargs, sticky probability the doc gives for the id, steps, reset mid-episode at)
    "pong_v5": ("ALE/Pong-v5", "pong", {}, 0.25, 250, 125),
    "pong_v5_cap101": ("ALE/Pong-v5", "pong", {"max_num_frames_per_episode": 101}, 0.25, 200, None),
    "pong_v4": ("PongNoFrameskip-v4", "pong", {"max_num_frames_per_episode": 401}, 0.0, 200, None),
    "breakout_v5": ("ALE/Breakout-v5", "breakout", {}, 0.25, 200, None),
}


def compare(case: str, wrong: str | None = None) -> tuple[str | None, dict]:
    """Step both sides through the case's fixed actions; (first difference or None, what happened)."""
    env_id, game, kwargs, sticky, steps, reset_at = CASES[case]
    ref = make_env(env_id, **kwargs)
    doc = DocAtari(game, sticky, kwargs.get("max_num_frames_per_episode", 108_000), wrong=wrong)
    seen = {"ended_at": set(), "terminated": 0, "truncated": 0, "rewards": 0, "lives": set(), "resets": 0}

    def reset(seed=None):
        obs, info = ref.reset(seed=seed)
        mine = doc.reset(seed=seed)
        seen["resets"] += 1
        assert info["episode_frame_number"] == doc.noops, "the no-op count is not pinned"
        return obs, mine

    try:
        obs, mine = reset(SEED)
        if not np.array_equal(obs, mine):
            return "reset observation", seen
        actions = np.random.default_rng(0).integers(0, ref.action_space.n, steps)
        for t, a in enumerate(actions):
            if t == reset_at:
                obs, mine = reset()
                if not np.array_equal(obs, mine):
                    return f"observation after the reset at step {t}", seen
            obs, reward, terminated, truncated, info = ref.step(int(a))
            mine, my_reward, my_terminated, my_truncated = doc.step(int(a))
            assert obs.dtype == np.uint8 and obs.shape == (4, 84, 84)
            if not np.array_equal(obs, mine):
                return f"observation at step {t} ({int((obs != mine).sum())} bytes)", seen
            theirs, ours = (reward, terminated, truncated), (my_reward, my_terminated, my_truncated)
            if theirs != ours:
                return f"step {t}: (reward, terminated, truncated) {theirs} vs {ours}", seen
            seen["rewards"] += reward != 0
            seen["lives"].add(info["lives"])
            if terminated or truncated:
                seen["terminated"] += terminated
                seen["truncated"] += truncated
                seen["ended_at"].add(doc.ended_at)
                obs, mine = reset()
                if not np.array_equal(obs, mine):
                    return f"observation of the reset after step {t}", seen
        return None, seen
    finally:
        ref.close()


@pytest.mark.parametrize("case", list(CASES))
def test_the_doc_reproduces_make_env(case):
    difference, seen = compare(case)
    assert difference is None, f"{case}: the doc's preprocessing differs from make_env's at {difference}"
    # Make sure each case covered what it is there for.
    if case == "pong_v5":
        assert seen["rewards"] > 0 and seen["resets"] == 2
    elif case == "pong_v5_cap101":
        # 101 frames from the reset, of which 1-30 are no-ops: the cap falls on each of a step's 4 frames.
        assert seen["ended_at"] == {1, 2, 3, 4} and seen["truncated"] > 4 and seen["terminated"] == 0
    elif case == "pong_v4":
        assert seen["truncated"] >= 2
    elif case == "breakout_v5":  # 5 lives: lives lost without an end, then a game over ends the episode
        assert seen["lives"] >= {1, 2, 3, 4, 5} and seen["terminated"] >= 1 and seen["truncated"] == 0


@pytest.mark.parametrize("wrong", WRONG)
def test_a_wrong_reading_does_not_match(wrong):
    case = "pong_v5_cap101" if wrong == "final_screen_at_end" else "pong_v5"
    difference, _ = compare(case, wrong)
    assert difference is not None, f"{wrong} should not reproduce make_env"


def test_the_documented_defaults():
    """Registration and settings the doc states: sticky 0.25 (v5) / 0 (v4), a 108000-frame cap, no TimeLimit."""
    for env_id, sticky in (("ALE/Pong-v5", 0.25), ("PongNoFrameskip-v4", 0.0)):
        env = make_env(env_id)
        try:
            assert gym.spec(env_id).max_episode_steps is None
            chain, e = [], env
            while isinstance(e, gym.Wrapper):
                chain.append(type(e).__name__)
                e = e.env
            assert "TimeLimit" not in chain, chain
            ale = env.unwrapped.ale
            assert ale.getFloat("repeat_action_probability") == pytest.approx(sticky)
            assert ale.getInt("max_num_frames_per_episode") == 108_000 and ale.getInt("frame_skip") == 1
            assert env.unwrapped.get_action_meanings() == ["NOOP", "FIRE", "RIGHT", "LEFT", "RIGHTFIRE", "LEFTFIRE"]
            assert env.observation_space == gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
        finally:
            env.close()
    env = make_env("ALE/Pong-v5", full_action_space=True)
    try:
        assert env.action_space.n == 18 and env.unwrapped.get_action_meanings()[0] == "NOOP"
    finally:
        env.close()
