"""Configuration helpers that depend on the machine: usable CPUs under a container's CPU quota."""

import os

import pytest

from impala_async.config import LearnerConfig, usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    "cpu_max,want",
    [
        ("max 100000\n", AFFINITY),  # no quota
        ("150000 100000\n", min(AFFINITY, 2)),  # --cpus 1.5 rounds up to 2
        ("50000 100000\n", 1),  # --cpus 0.5 still gets one
        ("6400000 100000\n", AFFINITY),  # a quota above the affinity mask: the mask wins
        ("not a cgroup file\n", AFFINITY),
    ],
)
def test_usable_cpus_honours_the_cgroup_quota(tmp_path, cpu_max, want):
    path = tmp_path / "cpu.max"
    path.write_text(cpu_max)
    assert usable_cpus(str(path)) == want


def test_usable_cpus_without_a_cgroup_file(tmp_path):
    assert usable_cpus(str(tmp_path / "missing")) == AFFINITY


def test_auto_actor_count_keeps_a_core_for_the_learner():
    assert LearnerConfig.of(num_actors=-1).local_actors == max(1, usable_cpus() - 1)
    assert LearnerConfig.of(num_actors=5).local_actors == 5
