#!/usr/bin/env bash
# Build the Dockerfile with podman and run the built image's own entry point, where no container engine runs.
#
#   sudo bash tools/prove_dockerfile.sh            # needs root, podman, debootstrap (apt-get install podman debootstrap)
#
# Where `podman run` cannot start a container (here: crun may not set RLIMIT_NOFILE), the image is run the way a
# container would run it: its filesystem as the lower layer of an overlay with a fresh writable upper layer, with
# /proc and /dev, as the image's USER, in its WORKDIR, with its ENV, its ENTRYPOINT and CMD, and a host folder at
# /data/runs (docker run -v). What that leaves out: namespaces, cgroups and the GPU.
#
# Checks, each printed as PASS/FAIL: the default command learns CartPole (mean return >= 475) and exits 0;
# ALE/Pong-v5 trains on a tiny budget; SIGTERM writes a final checkpoint and exits 0 within 15 s with no process
# left; the process runs as uid 1000; the learner refuses a public address without CURVE keys; the image has its
# HEALTHCHECK, ENV IMPALA_ASYNC_METRICS_PORT=9481 and EXPOSE 9481, and the HEALTHCHECK's own command succeeds
# against a learner running from the image and fails once none runs. (The chroot shares this machine's network:
# port 9481 on its loopback must be free.)
#
# Env: BASE_IMAGE (default: a Debian bookworm + python3 image made here with debootstrap), TORCH_SPEC (default
# torch==2.13.0, taken from /opt/wheels where it exists), KEEP=1 keeps the image.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=localhost/impala-async:proof
WORK=$(mktemp -d /tmp/prove-docker.XXXXXX)
fails=0
check() { if eval "$2"; then echo "PASS  $1"; else echo "FAIL  $1"; fails=$((fails + 1)); fi; }

# ---- the image, built from a base image made here (tools/container_image.sh)
source tools/container_image.sh
build_image "$IMAGE" "$WORK"

# ---- the image's runtime configuration
inspect() { podman image inspect "$IMAGE" --format "$1"; }
user=$(inspect '{{.Config.User}}')
workdir=$(inspect '{{.Config.WorkingDir}}')
mapfile -t image_env < <(inspect '{{range .Config.Env}}{{println .}}{{end}}' | sed '/^$/d')
mapfile -t entrypoint < <(inspect '{{range .Config.Entrypoint}}{{println .}}{{end}}' | sed '/^$/d')
mapfile -t default_cmd < <(inspect '{{range .Config.Cmd}}{{println .}}{{end}}' | sed '/^$/d')
echo "USER=$user WORKDIR=$workdir ENTRYPOINT=${entrypoint[*]} CMD=${default_cmd[*]}"
# HEALTHCHECK and exposed ports, read from the inspect JSON (podman puts the healthcheck beside Config, not in it)
podman image inspect "$IMAGE" > "$WORK/inspect.json"
mapfile -t health_cmd < <(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); d=d[0] if isinstance(d,list) else d
h=d.get("Healthcheck") or d.get("HealthCheck") or (d.get("Config") or {}).get("Healthcheck") or {}
t=h.get("Test") or []; print("\n".join(t[1:] if t[:1]==["CMD"] else []))' "$WORK/inspect.json")
exposed=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); d=d[0] if isinstance(d,list) else d
print(" ".join(sorted((d.get("Config") or {}).get("ExposedPorts") or {})))' "$WORK/inspect.json")
echo "HEALTHCHECK CMD=${health_cmd[*]:-none} EXPOSE=$exposed"

# ---- a container's filesystem: the image read-only below, a writable layer above, /data/runs from the host
lower=$(podman image mount "$IMAGE")
root="$WORK/root"
mkdir -p "$WORK/upper" "$WORK/overlay-work" "$root" "$WORK/runs"
mount -t overlay overlay -o "lowerdir=$lower,upperdir=$WORK/upper,workdir=$WORK/overlay-work" "$root"
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount -t tmpfs -o mode=1777 tmpfs "$root/dev/shm"
mount --bind "$WORK/runs" "$root/data/runs"
uid=$(chroot "$root" id -u "$user")
chown "$uid" "$WORK/runs"
cleanup() {
  set +e
  pkill -9 -f "^/opt/venv/bin/python.*impala" 2>/dev/null  # only if something escaped the checks below
  umount "$root/data/runs" "$root/dev/shm"; umount -R "$root/dev"; umount "$root/proc" "$root"
  podman image umount "$IMAGE" > /dev/null
  [ "${KEEP:-0}" = 1 ] || podman rmi "$IMAGE" > /dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT

# run_argv_in_image LIMIT_S LOG ARGV...: ARGV as the image's user, in its WORKDIR, with its ENV, stopped after
# LIMIT_S seconds (how Docker runs a HEALTHCHECK CMD: without the entry point)
run_argv_in_image() {
  local limit=$1 log=$2; shift 2
  timeout -k 5 "$limit" chroot --userspec="$uid:$uid" "$root" /usr/bin/env -i HOME="/home/$user" "${image_env[@]}" \
    /bin/sh -c 'cd "$0" && exec "$@"' "$workdir" "$@" > "$log" 2>&1
}

# run_in_image LIMIT_S LOG ARGS...: the entry point with ARGS (none: the image's CMD), likewise
run_in_image() {
  local limit=$1 log=$2; shift 2
  local args=("$@"); [ ${#args[@]} -gt 0 ] || args=("${default_cmd[@]}")
  run_argv_in_image "$limit" "$log" "${entrypoint[@]}" "${args[@]}"
}

best_return() {  # the best mean return in the newest metrics.jsonl under runs/
  python3 -c 'import json,sys; rows=[json.loads(l) for l in open(sys.argv[1])]
print(max((r.get("episode_return_mean") or 0) for r in rows))' "$(ls -t "$WORK"/runs/*/metrics.jsonl | head -1)"
}

# 1. the default command, as `docker run impala-async` would run it
rc=0; run_in_image 300 "$WORK/default.log" || rc=$?
best=$(best_return 2>/dev/null || echo 0)
check "default CMD (${default_cmd[*]}) exits 0 [rc=$rc]" '[ "$rc" = 0 ]'
check "default CMD learns CartPole: best mean return $best >= 475" "python3 -c 'import sys; sys.exit(float(\"$best\") < 475)'"
check "runs and checkpoints land in the mounted /data/runs, owned by uid $uid" \
  '[ -n "$(find "$WORK/runs" -name "checkpoint-*.pt" -user "$uid" | head -1)" ]'

# 2. real Atari from the atari extra
rc=0; run_in_image 300 "$WORK/pong.log" train --env ALE/Pong-v5 --num-actors 1 --envs-per-actor 2 \
  --unroll-length 20 --batch-size 2 --total-env-steps 400 --logdir /data/runs/pong || rc=$?
check "ALE/Pong-v5 trains on a tiny budget [rc=$rc]" '[ "$rc" = 0 ] && [ -s "$WORK/runs/pong/metrics.jsonl" ]'

# 3. SIGTERM (docker stop): final checkpoint, exit 0, nothing left behind
run_in_image 300 "$WORK/stop.log" train --env CartPole-v1 --total-env-steps 100000000 --logdir /data/runs/stop &
runner=$!
deadline=$((SECONDS + 120))
until [ -s "$WORK/runs/stop/metrics.jsonl" ] || [ $SECONDS -gt $deadline ]; do sleep 0.5; done
pid=$(pgrep -f -- "--logdir /data/runs/stop" | while read -r p; do
  [ "$(readlink "/proc/$p/root")" = "$root" ] && [ "$(awk '/^Uid/{print $2}' "/proc/$p/status")" = "$uid" ] &&
  grep -q impala-async "/proc/$p/cmdline" && echo "$p"; done | head -1)
check "the learner runs as uid $uid (USER $user), not root" '[ -n "$pid" ]'
rc=0; run_argv_in_image 60 "$WORK/health-up.log" "${health_cmd[@]}" || rc=$?
check "HEALTHCHECK (${health_cmd[*]}) succeeds against the running learner [rc=$rc: $(head -c 80 "$WORK/health-up.log")]" \
  '[ "${#health_cmd[@]}" -gt 0 ] && [ "$rc" = 0 ] && grep -q "^200 ok" "$WORK/health-up.log"'
t0=$SECONDS; kill -TERM "$pid" 2>/dev/null || true
rc=0; timeout 20 tail --pid="$runner" -f /dev/null || rc=124; wait "$runner" || rc=$?
stop_s=$((SECONDS - t0))
check "SIGTERM: exit 0 within 15 s [rc=$rc, ${stop_s} s]" '[ "$rc" = 0 ] && [ "$stop_s" -le 15 ]'
check "SIGTERM: a final checkpoint was written" '[ -n "$(ls "$WORK"/runs/stop/checkpoint-*.pt 2>/dev/null)" ]'
left=$(for p in /proc/[0-9]*; do [ "$(readlink "$p/root" 2>/dev/null)" = "$root" ] && basename "$p"; done || true)
check "SIGTERM: no process left in the image [${left:-none}]" '[ -z "$left" ]'
rc=0; run_argv_in_image 60 "$WORK/health-down.log" "${health_cmd[@]}" || rc=$?
check "HEALTHCHECK fails with no learner running [rc=$rc]" '[ "${#health_cmd[@]}" -gt 0 ] && [ "$rc" = 1 ]'

# 4. refusal to listen publicly without CURVE
rc=0; run_in_image 120 "$WORK/refuse.log" learner --listen tcp://0.0.0.0:5555 || rc=$?
check "learner on 0.0.0.0 without --curve-keys refuses to start [rc=$rc]" \
  '[ "$rc" != 0 ] && [ "$rc" != 124 ] && grep -qi curve "$WORK/refuse.log"'

# 5. the image's metrics configuration
check "HEALTHCHECK is impala-async healthcheck [${health_cmd[*]:-none}]" '[ "${health_cmd[*]}" = "impala-async healthcheck" ]'
check "EXPOSE 9481 [$exposed]" '[[ " $exposed " == *" 9481/tcp "* ]]'
check "ENV IMPALA_ASYNC_METRICS_PORT=9481" 'printf "%s\n" "${image_env[@]}" | grep -qx IMPALA_ASYNC_METRICS_PORT=9481'

echo "$fails check(s) failed"
[ "$fails" = 0 ]
