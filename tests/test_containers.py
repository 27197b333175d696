"""Real containers: tools/prove_containers.sh's check 2 (a learner container and actor containers that attach to it by
its address on a podman network, CURVE keys, a refused key, the learner killed and resumed) run as a subprocess.

Slow (about 4 minutes with the image built, plus 3 to 4 to build it the first time): `pytest -m slow
tests/test_containers.py`. Needs root, podman and runc (Debian: `apt-get install podman runc debootstrap`); skipped
with the reason otherwise. REUSE=1 keeps and reuses the image between runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "prove_containers.sh"


def missing() -> str:
    if os.geteuid() != 0:
        return "podman containers on a bridge network need root here"
    for tool in ("podman", "runc", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install podman runc debootstrap)"
    return ""


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.skipif(bool(missing()), reason=missing() or "ready")
def test_actor_containers_attach_to_a_learner_container_by_address():
    env = {**os.environ, "CHECKS": "2", "REUSE": "1", "KEEP": "1"}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=1800)
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-2000:]
    passed = re.findall(r"^PASS  (2[a-d])", out, re.M)
    assert sorted(set(passed)) == ["2a", "2b", "2c", "2d"] and "FAIL" not in out, out
    assert re.search(r"left behind: 0 containers", out), out  # nothing it started outlives it
