#!/usr/bin/env bash
# Every GPU check of this project in one bounded run, for a lent device machine (one GPU, Python 3.12 with its own
# torch, no internet). Prepare here, then one call:
#
#   bash tools/fetch_gpu_wheels.sh                       # here: the missing packages as cp312 wheels in .whl/
#   device run: command "bash tools/gpu_check.sh", carry [".whl"], timeout_s 560
#
# Each step has its own timeout, so a hang costs one step, not the run. Everything lands in two files under $OUT
# (the device returns at most 8): gpu_check.log (all output, by step) and results.jsonl (one JSON object per
# measurement, plus one per step with its exit code and seconds). Off a GPU (NO_WHEELS=1 PY=.venv/bin/python
# OUT=/tmp/x) it runs the same steps, and the CUDA ones fail fast or skip. Typical run: about 6.5 minutes, plus
# about 2.5 for step 7 (the actors' forward pass on the GPU). ONLY=REGEX runs only the steps whose names match, e.g.
# ONLY='environment|actor' bash tools/gpu_check.sh for step 7 alone (about 2.5 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
PY=${PY:-python3}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
RESULTS=$OUT/results.jsonl
: > "$LOG"
: > "$RESULTS"
export PYTHONUNBUFFERED=1
if [ -z "${NO_WHEELS:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$LOG" 2>&1 || { echo "wheel install failed" >> "$LOG"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi

# step NAME LIMIT_S CMD...: run with a timeout, output into the log, exit code and seconds into results.jsonl
step() {
  local name=$1 limit=$2; shift 2
  [ -n "${ONLY:-}" ] && ! [[ "$name" =~ $ONLY ]] && return 0
  local t0=$SECONDS rc=0
  echo "===== $name (limit ${limit} s): $*" >> "$LOG"
  timeout -k 10 "$limit" "$@" >> "$LOG" 2>&1 || rc=$?
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}" >> "$RESULTS"
  echo "$name rc=$rc $((SECONDS - t0)) s"
}
# json_step NAME LIMIT_S CMD...: as step, and the command's JSON lines (stdout) go to results.jsonl too
json_step() {
  local name=$1 limit=$2; shift 2
  [ -n "${ONLY:-}" ] && ! [[ "$name" =~ $ONLY ]] && return 0
  local t0=$SECONDS rc=0 tmp
  tmp=$(mktemp)
  echo "===== $name (limit ${limit} s): $*" >> "$LOG"
  timeout -k 10 "$limit" "$@" > "$tmp" 2>> "$LOG" || rc=$?
  cat "$tmp" >> "$LOG"
  grep '^{' "$tmp" | sed "s/^{/{\"step\": \"$name\", /" >> "$RESULTS"
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}" >> "$RESULTS"
  echo "$name rc=$rc $((SECONDS - t0)) s"
  rm -f "$tmp"
}

# 1. what machine this is
step environment 60 bash -c "nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; \
  nproc; $PY -c 'import sys, torch; print(sys.version); print(torch.__version__, torch.version.cuda, \
  torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'; \
  $PY -c 'import impala_async, gymnasium, zmq, lz4, cramjam, msgpack, uvloop, ale_py, cv2; print(\"imports ok\")'"

# 2. the CUDA tests (they skip on a CPU): pinned ring, the copy stream's ordering, learner and V-trace on the GPU
step pytest_cuda 150 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_ring.py tests/test_trainer.py \
  tests/test_learn.py tests/test_vtrace.py tests/test_actor_device.py

# 3. the real CLI end to end with the learner on the GPU (device auto)
step pytest_cli 120 "$PY" -m pytest -q -p no:cacheprovider -x tests/test_cli.py

# 4. CartPole with the learner on the GPU: time to 475, steady env steps/s
json_step cartpole_cuda 80 "$PY" tools/time_to_return.py --seeds 0 --timeout-s 60 --json -- --env CartPole-v1 \
  --device cuda

# 5. Atari-sized batches through the full training path: copy/compute overlap against serial copies, and bf16
for variant in overlap serial bf16; do
  flags=()
  [ "$variant" = serial ] && flags=(--learner-flag=--overlap-copies=0)
  [ "$variant" = bf16 ] && flags=(--learner-flag=--precision=bf16)
  json_step "loadtest_atari_train_$variant" 55 "$PY" tools/loadtest.py --obs atari --train --actors 8 --seconds 15 \
    --json "${flags[@]}"
done

# 5b. the learner's update alone on the GPU, fed from memory (no ingest): agent steps/s one rank trains
for model in shallow deep; do
  for precision in fp32 bf16; do
    json_step "update_${model}_${precision}" 45 "$PY" tools/update_shares.py --device cuda --updates 30 --warmup 5 \
      --json -- --env ALE/Pong-v5 --model "$model" --precision "$precision" --batch-size 32 --unroll-length 80
  done
done

# 6. real Pong on the GPU for a minute: env steps/s with every core acting, learner updates/s
json_step pong_cuda 90 "$PY" tools/time_to_return.py --seeds 0 --target 21 --timeout-s 75 --json -- \
  --env ALE/Pong-v5 --device cuda --envs-per-actor 16 --unroll-length 80 --batch-size 32 --optimizer rmsprop \
  --learning-rate 4.8e-4 --entropy-cost 0.0006 --reward-clip 1 --reward-scale 1 --precision bf16

# 7. the actors' forward pass on the GPU (--actor-device cuda). One actor core (pinned), 32 Pong environments, the
#    Nature CNN on the GPU against the CPU: env frames/s = 4 x agent steps/s (tools/bench_actor.py; EnvPool too where
#    the image has it). Then a short Pong train whose local actors act on the GPU: its sps (agent steps/s, all actors
#    together) x 4 are the actors' env frames/s.
backends=gymnasium
"$PY" -c "import envpool" 2> /dev/null && backends=gymnasium,envpool
for dev in cuda cpu; do
  json_step "bench_actor_$dev" 100 "$PY" tools/bench_actor.py --env ALE/Pong-v5 --envs 32 --steps 400 \
    --backends "$backends" --device "$dev" --json
done
json_step pong_actor_cuda 70 "$PY" tools/time_to_return.py --seeds 0 --target 21 --timeout-s 45 --json -- \
  --env ALE/Pong-v5 --device cuda --actor-device cuda --envs-per-actor 32 --unroll-length 80 --batch-size 32 \
  --optimizer rmsprop --learning-rate 4.8e-4 --entropy-cost 0.0006 --reward-clip 1 --reward-scale 1

echo "done; results in $RESULTS" | tee -a "$LOG"
