#!/usr/bin/env bash
# The image as users run it: real containers (podman with the runc runtime) on a podman bridge network.
#
#   sudo bash tools/prove_containers.sh               # every check
#   sudo CHECKS=2 REUSE=1 bash tools/prove_containers.sh   # only check 2, with an image built before (KEEP=1)
#
# Installs what it lacks (Debian: podman runc debootstrap), builds the image as tools/prove_dockerfile.sh does
# (tools/container_image.sh; REUSE=1 takes an existing $IMAGE), prints PASS/FAIL per check, each check's time and a
# summary, and removes every container, network and volume it made (each carries the label impala-proof=$TAG);
# its last line counts what is left of them: 0.
#
# Checks:
#  1. `podman run IMAGE` (its default command) learns CartPole and exits 0; `podman healthcheck run` passes while a
#     run trains and the container reports healthy; `podman stop` (SIGTERM) leaves a final checkpoint in the mounted
#     /data/runs and exits 0 within the stop timeout.
#  2. External actors by address: a learner container (`impala-async learner` on its container address, CURVE keys
#     mounted read-only) and two actor containers, each `impala-async actor --learner tcp://<learner address>:5555`
#     with its own key: the learner reaches 475 on their data, counted per key on /metrics; an actor container with an
#     unlisted key gets no weights and has nothing accepted; the learner container killed (SIGKILL) and started again
#     with --resume at the same address: the actor containers keep running and attached, none of their messages
#     rejected.
#  3. The Kubernetes manifests played: `podman kube play` on the CPU overlay (deploy/k8s/overlays/cpu) as
#     tools/k8s_render.py renders it, keys from Secrets made as README's `kubectl create secret` makes them: the
#     learner and the actor pods come up and CartPole learns; `podman kube down` removes them. What podman 4.3 does
#     not honour, and what stands in for it, is printed (tools/k8s_render.py --podman: no $(VAR) expansion, no
#     Services, no replicas above 1, no NetworkPolicies; probes are checked with their own request from here).
#  4. Compose: podman-compose (PyPI) with deploy/compose.yaml and its CPU override deploy/compose.cpu.yaml, profile
#     monitoring: the learner learns CartPole, and a real Prometheus (Debian's, in an image made here: no registry
#     pulls) scrapes the learner's /metrics with deploy/prometheus.yml, its target up under the job's labels.
#
# Containers run with --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 (raising limits is not permitted on these
# machines; crun refuses their cgroups, so --runtime runc). Traffic: the podman network's own addresses and loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
CHECKS=${CHECKS:-1,2,3,4}
IMAGE=${IMAGE:-localhost/impala-async:proof}
TAG=impala-proof-$$
WORK=$(mktemp -d /tmp/prove-containers.XXXXXX)
RUN=(podman --runtime runc run --label "impala-proof=$TAG" --ulimit nofile=1024:1024 --ulimit nproc=1024:1024)
# podman's own complaints (no systemd here to time HEALTHCHECKs; no syslog) go to a log, not between the checks
PODMAN_LOG=$WORK/podman.log
# for `podman kube play`, which takes neither --runtime nor --ulimit: the same settings, for this script's podman only
export CONTAINERS_CONF=$WORK/containers.conf
printf '[containers]\ndefault_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]\n[engine]\nruntime = "runc"\n' \
  > "$CONTAINERS_CONF"
UID_IN_IMAGE=1000
PROMETHEUS_IMAGE=localhost/impala-proof-prometheus:debian
fails=0
passes=0
check() {
  if eval "$2"; then echo "PASS  $1"; passes=$((passes + 1)); else echo "FAIL  $1"; fails=$((fails + 1)); fi
}
wanted() { [[ ",$CHECKS," == *",$1,"* ]]; }
left() {  # containers, networks and volumes of this run still present (with check 3: kube play's impala-* ones)
  local n
  n=$(( $(podman ps -aq --filter "label=impala-proof=$TAG" | wc -l)
    + $(podman ps -aq --filter "label=io.podman.compose.project=$TAG" | wc -l)
    + $(podman volume ls -q --filter "name=^${TAG}_" | wc -l)
    + $(podman network ls -q --filter "name=^${TAG}_" | wc -l)
    + $(podman network ls -q --filter "label=impala-proof=$TAG" | wc -l)
    + $(podman volume ls -q --filter "label=impala-proof=$TAG" | wc -l) ))
  if [ -n "${KUBE_MADE:-}" ]; then
    n=$(( n + $(podman ps -aq --filter "name=^impala-(learner|actors)" | wc -l)
      + $(podman volume ls -q --filter "name=^impala-(runs|learner-|actors-)" | wc -l) ))
  fi
  echo "$n"
}
cleanup() {
  set +e
  podman ps -aq --filter "label=impala-proof=$TAG" | xargs -r podman rm -f -t 0 > /dev/null 2>&1
  podman network ls -q --filter "label=impala-proof=$TAG" | xargs -r podman network rm -f > /dev/null 2>&1
  podman volume ls -q --filter "label=impala-proof=$TAG" | xargs -r podman volume rm -f > /dev/null 2>&1
  for f in "$WORK"/kube-*.yaml; do [ -f "$f" ] && podman kube down "$f" > /dev/null 2>&1; done
  [ -z "${COMPOSE_UP:-}" ] || "${COMPOSE[@]}" down -v > /dev/null 2>&1
  [ -n "${KEEP_PROMETHEUS:-}" ] || podman rmi "$PROMETHEUS_IMAGE" > /dev/null 2>&1
  [ -z "${TAGGED:-}" ] || podman rmi localhost/impala-async:latest > /dev/null 2>&1
  if [ -n "${KUBE_MADE:-}" ]; then
    podman volume ls -q --filter "name=^impala-(runs|learner-|actors-)" | xargs -r podman volume rm -f
  fi > /dev/null 2>&1
  [ "${KEEP:-0}" = 1 ] || [ "${REUSE:-0}" = 1 ] || podman rmi "$IMAGE" > /dev/null 2>&1
  echo "left behind: $(left) containers, networks and volumes labelled impala-proof=$TAG (and of kube play's)"
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

# ---- what it needs
if ! command -v podman > /dev/null || ! command -v runc > /dev/null || ! command -v debootstrap > /dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc debootstrap > "$WORK/apt.log" 2>&1 ||
    { tail -20 "$WORK/apt.log"; exit 1; }
fi
source tools/container_image.sh
if [ "${REUSE:-0}" = 1 ] && podman image exists "$IMAGE"; then
  echo "reusing $IMAGE; size $(podman image inspect "$IMAGE" --format '{{.Size}}' | awk '{printf "%.0f MB", $1 / 1e6}')"
else
  build_image "$IMAGE" "$WORK"
fi

# best_return RUNDIR: the best mean return of RUNDIR/metrics.jsonl (0 if none yet)
best_return() {
  python3 -c 'import json, sys
best = 0.0
for line in open(sys.argv[1]):
    try:
        best = max(best, json.loads(line).get("episode_return_mean") or 0.0)
    except ValueError:
        pass
print(best)' "$1/metrics.jsonl" 2> /dev/null || echo 0
}
at_least() { python3 -c 'import sys; sys.exit(float(sys.argv[1] or 0) < float(sys.argv[2]))' "$1" "$2"; }
# wait_for SECONDS COMMAND: poll COMMAND every half second until it succeeds (0) or the time is up (1)
wait_for() {
  local deadline=$((SECONDS + $1))
  until eval "$2"; do [ $SECONDS -lt $deadline ] || return 1; sleep 0.5; done
}
state() { podman inspect "$1" --format "$2" 2> /dev/null; }
# the image as the manifests and the compose file name it (impala-async:latest), removed again at the end
tag_latest() {
  podman image exists localhost/impala-async:latest && return
  podman tag "$IMAGE" localhost/impala-async:latest && TAGGED=1
}
runs_dir() { mkdir -p "$WORK/$1" && chown "$UID_IN_IMAGE:$UID_IN_IMAGE" "$WORK/$1" && echo "$WORK/$1"; }

# ---- 1. the default command; healthcheck; podman stop
if wanted 1; then
  t0=$SECONDS
  runs=$(runs_dir runs-default)
  rc=0; timeout 900 "${RUN[@]}" --name "$TAG-default" -v "$runs:/data/runs" "$IMAGE" > "$WORK/default.log" 2>&1 ||
    rc=$?
  best=$(best_return "$(ls -d "$runs"/*/ | head -1)")
  check "1a podman run IMAGE (default CMD) exits 0 [rc=$rc]" '[ "$rc" = 0 ]'
  check "1a ... and learns CartPole: best mean return $best >= 475" 'at_least "$best" 475'
  check "1a ... and leaves its checkpoints in the mounted /data/runs" \
    '[ -n "$(find "$runs" -name "checkpoint-*.pt" -user "$UID_IN_IMAGE" | head -1)" ]'

  runs=$(runs_dir runs-stop)
  "${RUN[@]}" -d --name "$TAG-stop" -v "$runs:/data/runs" "$IMAGE" train --env CartPole-v1 \
    --total-env-steps 100000000 --logdir /data/runs/stop > /dev/null 2>> "$PODMAN_LOG"
  wait_for 300 '[ -s "$runs/stop/metrics.jsonl" ]' || true
  rc=0; podman healthcheck run "$TAG-stop" > "$WORK/health.log" 2>> "$PODMAN_LOG" || rc=$?
  health=$(state "$TAG-stop" '{{.State.Healthcheck.Status}}')
  check "1b podman healthcheck run passes while it trains [rc=$rc $(head -c 80 "$WORK/health.log")]" '[ "$rc" = 0 ]'
  check "1b the container reports healthy [$health]" '[ "$health" = healthy ]'
  t1=$SECONDS; podman stop -t 30 "$TAG-stop" > /dev/null 2>> "$PODMAN_LOG"; stop_s=$((SECONDS - t1))
  code=$(state "$TAG-stop" '{{.State.ExitCode}}')
  check "1c podman stop: exit code $code within the 30 s stop timeout [${stop_s} s]" \
    '[ "$code" = 0 ] && [ "$stop_s" -lt 30 ]'
  check "1c podman stop: a final checkpoint in the mounted /data/runs" \
    '[ -n "$(ls "$runs"/stop/checkpoint-*.pt 2> /dev/null)" ] && grep -q "final checkpoint" <(podman logs "$TAG-stop" 2>&1)'
  echo "      check 1: $((SECONDS - t0)) s"
fi

# ---- 2. a learner container and actor containers that attach by address
if wanted 2; then
  t0=$SECONDS
  subnet=10.89.$((RANDOM % 200 + 20))
  net=$TAG-net
  podman network create --label "impala-proof=$TAG" --subnet "$subnet.0/24" "$net" > /dev/null
  learner_ip=$subnet.10
  keys=$WORK/keys
  mkdir -p "$keys" && chown "$UID_IN_IMAGE" "$keys"
  for name in learner actor1 actor2 rogue; do  # keys made by the image's own keygen, as its user
    role=actor; [ "$name" = learner ] && role=learner
    "${RUN[@]}" --rm -v "$keys:/keys" "$IMAGE" keygen "/keys/$name" --name "$role" > /dev/null 2>> "$PODMAN_LOG"
  done
  mkdir -p "$keys/learner/allowed"
  cp "$keys/actor1/actor.key" "$keys/learner/allowed/actor1.key"  # rogue's key is not admitted
  cp "$keys/actor2/actor.key" "$keys/learner/allowed/actor2.key"
  for name in actor1 actor2 rogue; do cp "$keys/learner/learner.key" "$keys/$name/learner.key"; done
  chown -R "$UID_IN_IMAGE:$UID_IN_IMAGE" "$keys"
  chmod 700 "$keys/learner/allowed"
  runs=$(runs_dir runs-external)
  learner=(--network "$net" --ip "$learner_ip" -v "$keys/learner:/keys:ro" -v "$runs:/data/runs" "$IMAGE" learner
    --env CartPole-v1 --total-env-steps 100000000 --logdir /data/runs/learner --listen tcp://0.0.0.0:5555
    --publish tcp://0.0.0.0:5556 --curve-keys /keys --metrics-host 0.0.0.0 --metrics-port 9481
    --checkpoint-interval-s 10)
  "${RUN[@]}" -d --name "$TAG-learner" "${learner[@]}" > /dev/null 2>> "$PODMAN_LOG"
  for name in actor1 actor2 rogue; do
    "${RUN[@]}" -d --name "$TAG-$name" --network "$net" -v "$keys/$name:/keys:ro" "$IMAGE" actor \
      --learner "tcp://$learner_ip:5555" --curve-keys /keys --max-wait-for-weights-s 60 > /dev/null 2>> "$PODMAN_LOG"
  done
  metrics() { python3 -c 'import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "http://$learner_ip:9481/metrics" 2> /dev/null ||
    true; }
  by_key() { metrics | awk -v k="$1" -F'[{}" ]+' '$1 == "impala_async_trajectories_by_key_total" && $3 == k {print $4}'; }
  wait_for 600 'at_least "$(best_return "$runs/learner")" 475' || true
  best=$(best_return "$runs/learner")
  check "2a the learner container reaches 475 on the actor containers' data [best $best]" 'at_least "$best" 475'
  a1=$(by_key actor1); a2=$(by_key actor2)
  check "2b /metrics counts trajectories per actor key [actor1 ${a1:-none}, actor2 ${a2:-none}]" \
    'at_least "${a1:-0}" 1 && at_least "${a2:-0}" 1'
  keys_listed=$(metrics | grep -c '^impala_async_trajectories_by_key_total{' || true)
  # the rogue actor: refused at the handshake, no weights within its --max-wait-for-weights-s, restarted by its own
  # supervisor, refused again
  wait_for 150 'podman logs "$TAG-rogue" 2>&1 | grep -q "no weights from"' || true
  podman logs "$TAG-rogue" > "$WORK/rogue.log" 2>&1 || true
  check "2c the unlisted key is refused and gets no weights in 60 s [$(grep -c "refused this actor's key" "$WORK/rogue.log") refusals logged]" \
    'grep -q "refused this actor'"'"'s key" "$WORK/rogue.log" && grep -q "no weights from" "$WORK/rogue.log"'
  check "2c ... and nothing of it is accepted: /metrics lists 2 keys [$keys_listed]" '[ "$keys_listed" = 2 ]'
  started1=$(state "$TAG-actor1" '{{.State.StartedAt}}')
  wait_for 60 '[ -n "$(ls "$runs"/learner/checkpoint-*.pt 2> /dev/null)" ]' || true
  podman kill "$TAG-learner" > /dev/null 2>> "$PODMAN_LOG"; podman rm -f "$TAG-learner" > /dev/null 2>> "$PODMAN_LOG"
  "${RUN[@]}" -d --name "$TAG-learner" "${learner[@]}" --resume /data/runs/learner > /dev/null 2>> "$PODMAN_LOG"
  t1=$SECONDS
  # the resumed learner's own counters start from 0: fresh trajectories of both keys mean both reattached
  wait_for 300 'at_least "$(by_key actor1)" 1 && at_least "$(by_key actor2)" 1' || true
  attach_s=$((SECONDS - t1))
  b1=$(by_key actor1); b2=$(by_key actor2)
  check "2d after SIGKILL and --resume both actor containers are attached [actor1 ${b1:-none}, actor2 ${b2:-none}, ${attach_s} s]" \
    'at_least "${b1:-0}" 1 && at_least "${b2:-0}" 1'
  check "2d ... without being restarted" '[ "$(state "$TAG-actor1" "{{.State.Running}}")" = true ] &&
    [ "$(state "$TAG-actor1" "{{.State.StartedAt}}")" = "$started1" ] &&
    [ "$(state "$TAG-actor2" "{{.State.Running}}")" = true ]'
  rejected=$(metrics | awk '$1 ~ /^impala_async_rejected_messages_total[{]/ {n += $2; seen = 1} END {if (seen) print n}')
  dropped=$(metrics | awk '$1 == "impala_async_messages_dropped_incarnation_total" {print $2}')
  check "2d ... and none of their messages rejected [rejected ${rejected:-?}; from before the restart, dropped unread: ${dropped:-?}]" \
    '[ "${rejected:-x}" = 0 ]'
  echo "      check 2: $((SECONDS - t0)) s"
fi

# ---- 3. the Kubernetes manifests, played
if wanted 3; then
  t0=$SECONDS
  for thing in "volume exists impala-runs" "pod exists impala-learner-pod-0" "pod exists impala-actors-pod-0"; do
    if podman $thing 2> /dev/null; then echo "check 3: podman $thing already: not touching it"; exit 1; fi
  done
  KUBE_MADE=1
  tag_latest
  subnet=10.89.$((RANDOM % 200 + 20))
  podman network create --label "impala-proof=$TAG" --subnet "$subnet.0/24" "$TAG-kube" > /dev/null
  learner_ip=$subnet.10
  keys=$WORK/k8s-keys
  mkdir -p "$keys" && chown "$UID_IN_IMAGE" "$keys"
  for role in learner actor; do
    "${RUN[@]}" --rm -v "$keys:/keys" "$IMAGE" keygen "/keys/$role" --name "$role" > /dev/null 2>> "$PODMAN_LOG"
  done
  # the three Secrets of README's `kubectl create secret` commands, laid out as the kubelet presents a Secret
  # volume (files as links into ..data/, mode 0440, group 1000 from fsGroup): podman 4.3 cannot mount them itself
  secret_dir() {  # secret_dir NAME FILE...: $WORK/secrets/NAME holding each FILE under its base name
    local dir=$WORK/secrets/$1 stamp=..2026_01_01_00_00_00.000000001; shift
    mkdir -p "$dir/$stamp"
    for f in "$@"; do
      cp "$f" "$dir/$stamp/" && chown "0:$UID_IN_IMAGE" "$dir/$stamp/$(basename "$f")"
      chmod 0440 "$dir/$stamp/$(basename "$f")"; ln -s "..data/$(basename "$f")" "$dir/$(basename "$f")"
    done
    ln -s "$stamp" "$dir/..data"
  }
  cp "$keys/actor/actor.key" "$WORK/fleet.key"
  secret_dir impala-learner-key "$keys/learner/learner.key_secret"
  secret_dir impala-allowed-actors "$WORK/fleet.key"
  secret_dir impala-actor-key "$keys/actor/actor.key_secret" "$keys/learner/learner.key"
  render=(python3 tools/k8s_render.py deploy/k8s/overlays/cpu --podman --image localhost/impala-async:latest
    --service-ip "impala-learner=$learner_ip" --secret-dir "impala-learner-key=$WORK/secrets/impala-learner-key"
    --secret-dir "impala-allowed-actors=$WORK/secrets/impala-allowed-actors"
    --secret-dir "impala-actor-key=$WORK/secrets/impala-actor-key")
  "${render[@]}" --only Deployment/impala-learner,PersistentVolumeClaim/impala-runs > "$WORK/kube-learner.yaml" \
    2> "$WORK/render.log"
  "${render[@]}" --only Deployment/impala-actors,Deployment/impala-actors-2 > "$WORK/kube-actors.yaml" 2> /dev/null
  sed 's/^/      podman: /' "$WORK/render.log"
  rc=0; podman kube play --network "$TAG-kube" --ip "$learner_ip" "$WORK/kube-learner.yaml" > "$WORK/play.log" \
    2>> "$PODMAN_LOG" || rc=$?
  podman kube play --network "$TAG-kube" "$WORK/kube-actors.yaml" >> "$WORK/play.log" 2>> "$PODMAN_LOG" || rc=$?
  check "3a podman kube play: the learner pod, 2 actor pods and the PVC [rc=$rc]" '[ "$rc" = 0 ]'
  runs=$(podman volume inspect impala-runs --format '{{.Mountpoint}}' 2> /dev/null || echo /nonexistent)
  wait_for 600 'at_least "$(best_return "$runs/learner")" 475' || true
  best=$(best_return "$runs/learner")
  check "3b CartPole learns from the actor pods' data [best $best]" 'at_least "$best" 475'
  running=$(podman ps --filter "name=^impala-(learner|actors|actors-2)-pod-0-(learner|actor)$" -q | wc -l)
  check "3b the learner and both actor containers run [$running of 3]" '[ "$running" = 3 ]'
  code=$(python3 -c 'import sys, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=5).status)
except Exception as e:
    print(getattr(e, "code", e))' "http://$learner_ip:9481/healthz")
  check "3c the probes' request, GET /healthz on the pod's metrics port, answers [$code]" '[ "$code" = 200 ]'
  fleet=$(python3 -c 'import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
print(sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith("impala_async_trajectories_by_key_total{key=\"fleet\"")))' \
    "http://$learner_ip:9481/metrics" 2> /dev/null || echo 0)
  check "3c the actors' key from the Secret is the one admitted [fleet: $fleet trajectories]" 'at_least "$fleet" 1'
  rc=0
  for f in "$WORK/kube-actors.yaml" "$WORK/kube-learner.yaml"; do
    podman kube down "$f" > /dev/null 2>> "$PODMAN_LOG" || rc=$?
  done
  pods=$(podman pod ps -q --filter "name=^impala-(learner|actors)" | wc -l)
  check "3d podman kube down removes the pods [rc=$rc, $pods left]" '[ "$rc" = 0 ] && [ "$pods" = 0 ]'
  kept=$(podman volume ls -q --filter name=impala-runs | wc -l)
  echo "      the PVC's volume outlives kube down, as a PVC outlives its Deployment: $kept kept, then removed"
  podman volume ls -q --filter "name=^impala-(runs|learner-|actors-)" | xargs -r podman volume rm -f > /dev/null 2>&1
  echo "      check 3: $((SECONDS - t0)) s"
fi

# ---- 4. compose, with Prometheus
if wanted 4; then
  t0=$SECONDS
  if ! command -v podman-compose > /dev/null; then
    python3 -m venv "$WORK/compose-venv" && "$WORK/compose-venv/bin/pip" install -q podman-compose > "$WORK/pip.log" 2>&1 ||
      { tail -5 "$WORK/pip.log"; exit 1; }
    PATH=$WORK/compose-venv/bin:$PATH
  fi
  if podman image exists "$PROMETHEUS_IMAGE"; then KEEP_PROMETHEUS=1; else
    mkdir -p "$WORK/prometheus-image"
    base_image "$WORK"  # tools/container_image.sh: Debian bookworm, made here with debootstrap unless it exists
    printf '%s\n' "FROM $BASE_IMAGE" \
      'RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus \' \
      '  > /dev/null && rm -rf /var/lib/apt/lists/*' 'ENTRYPOINT ["/usr/bin/prometheus"]' > "$WORK/prometheus-image/Containerfile"
    podman build --isolation chroot -t "$PROMETHEUS_IMAGE" "$WORK/prometheus-image" > "$WORK/prometheus-build.log" 2>&1 ||
      { tail -10 "$WORK/prometheus-build.log"; exit 1; }
  fi
  tag_latest
  printf 'services:\n  prometheus:\n    image: %s\n' "$PROMETHEUS_IMAGE" > "$WORK/compose.proof.yaml"
  for port in 9481 9090; do  # compose publishes both on the host's loopback
    if python3 -c 'import socket, sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1)' "$port" 2> /dev/null; then
      echo "check 4: 127.0.0.1:$port is taken; compose.yaml publishes it"; exit 1
    fi
  done
  COMPOSE=(podman-compose -p "$TAG" --profile monitoring -f deploy/compose.yaml -f deploy/compose.cpu.yaml
    -f "$WORK/compose.proof.yaml")
  COMPOSE_UP=1
  rc=0; IMPALA_TOTAL_ENV_STEPS=100000000 "${COMPOSE[@]}" up -d > "$WORK/compose-up.log" 2>&1 || rc=$?
  check "4a podman-compose up (compose.yaml + compose.cpu.yaml, profile monitoring) [rc=$rc]" '[ "$rc" = 0 ]'
  runs=$(podman volume inspect "${TAG}_runs" --format '{{.Mountpoint}}' 2> /dev/null || echo /nonexistent)
  wait_for 600 'at_least "$(best_return "$runs/learner")" 475' || true
  best=$(best_return "$runs/learner")
  check "4b the compose learner learns CartPole [best $best]" 'at_least "$best" 475'
  prom() { python3 -c 'import json, sys, urllib.parse, urllib.request
print(json.dumps(json.load(urllib.request.urlopen("http://127.0.0.1:9090/api/v1/" + sys.argv[1], timeout=5))))' "$1" \
    2> /dev/null || echo '{}'; }
  target_up() { prom targets | python3 -c 'import json, sys
ts = (json.load(sys.stdin).get("data") or {}).get("activeTargets") or []
up = [t for t in ts if t["health"] == "up" and t["labels"].get("job") == "impala-learner"]
print(up[0]["labels"]["instance"] + " " + up[0]["scrapeUrl"] if up else "")'; }
  wait_for 120 '[ -n "$(target_up)" ]' || true
  target=$(target_up)
  check "4c Prometheus ($(podman run --rm "$PROMETHEUS_IMAGE" --version 2>&1 | head -1 | cut -d' ' -f1-3)) scrapes the learner: target up [${target:-none}]" \
    '[ -n "$target" ]'
  got=$(prom "query?query=impala_async_trajectories_received_total" | python3 -c 'import json, sys
r = (json.load(sys.stdin).get("data") or {}).get("result") or []
print(r[0]["metric"].get("job", "") + " " + r[0]["value"][1] if r else "")')
  check "4c ... and has impala_async_trajectories_received_total from it [${got:-nothing}]" \
    '[ "${got%% *}" = impala-learner ] && at_least "${got##* }" 1'
  rc=0; "${COMPOSE[@]}" down -v > "$WORK/compose-down.log" 2>&1 || rc=$?
  COMPOSE_UP=
  n=$(podman ps -aq --filter "label=io.podman.compose.project=$TAG" | wc -l)
  check "4d podman-compose down -v removes its containers [rc=$rc, $n left]" '[ "$rc" = 0 ] && [ "$n" = 0 ]'
  echo "      check 4: $((SECONDS - t0)) s"
fi

echo "$passes passed, $fails failed"
[ "$fails" = 0 ]
