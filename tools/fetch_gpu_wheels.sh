#!/usr/bin/env bash
# The packages the device machine (Python 3.12, its own torch, no internet) lacks, as wheels in .whl/ (git-ignored),
# for tools/gpu_check.sh. Run here, where PyPI is reachable:  bash tools/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# Already on the device (its package list): numpy, msgpack, uvloop, opencv-python-headless, cloudpickle,
# typing-extensions, psutil, pytest, hypothesis.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl gymnasium==1.4.0 farama-notifications lz4 cramjam pyzmq ale-py setproctitle
ls -la .whl
du -sh .whl
