"""tools/sf_pong.py: Sample Factory's log read into this project's metrics keys. The progress lines are ones Sample
Factory 2.1.1 printed for its Atari example on Pong on this machine; the reward line has the format
tools/compare_sample_factory.py reads from its CartPole runs (BENCHMARKS.md, section 3)."""

from __future__ import annotations

from helpers import tool

sf_pong = tool("sf_pong")
compare = tool("compare_sample_factory")

LINES = [
    "\x1b[36m[2026-12-03 14:50:06,294][09488] Fps is (10 sec: nan, 60 sec: nan, 300 sec: nan). Total num frames: 0. "
    "Throughput: 0: nan. Samples: 0. Policy #0 lag: (min: -1.0, avg: -1.0, max: -1.0)\x1b[0m",
    "\x1b[36m[2026-12-03 14:50:31,274][09488] Fps is (10 sec: 409.6, 60 sec: 164.0, 300 sec: 164.0). Total num frames: "
    "4096. Throughput: 0: 44.1. Samples: 1102. Policy #0 lag: (min: 15.0, avg: 15.0, max: 15.0)\x1b[0m",
    "[2026-12-03 15:10:02,001][09488] Avg episode reward: [(0, '-20.417')]",
    "\x1b[36m[2026-12-03 14:49:24,246][09494] Env info: EnvInfo(obs_space=Dict('obs': Box(0, 255, (4, 84, 84), uint8)),"
    " reward_shaping_scheme=None)\x1b[0m",
]


def test_frames_become_agent_steps_and_the_return_is_carried():
    state = {"env_steps": 0, "episode_return_mean": None}
    records = [sf_pong.parse(line, state) for line in LINES]
    assert records[0] == {"env_steps": 0, "episode_return_mean": None}
    assert records[1] == {"env_steps": 1024, "episode_return_mean": None}, "4,096 frames are 1,024 agent steps"
    assert records[2] == {"env_steps": 1024, "episode_return_mean": -20.417}
    assert records[3] is None, "a line that reports neither"


def test_the_cartpole_comparison_reads_the_same_lines():
    """tools/compare_sample_factory.py's Sample Factory half (its venv is not CI's): the rate of the last 10 s and the
    frames from the progress line, the return from the reward line sf_pong reads."""
    assert compare.FPS.search(LINES[1]).groups() == ("409.6", "164.0", "164.0", "4096")
    assert compare.FPS.search(LINES[0]).group(1) == "nan", "the first report has no rate yet: skipped by the reader"
    assert compare.REWARD.search(LINES[2]).group(1) == "-20.417"
