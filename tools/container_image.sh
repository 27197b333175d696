# Sourced by tools/prove_dockerfile.sh and tools/prove_containers.sh: build the repository's Dockerfile with podman,
# from a base image made here (no registry pulls on these machines).
#
#   source tools/container_image.sh; build_image IMAGE WORKDIR     # sets BASE_IMAGE, BUILD_S and IMAGE_MB
#
# Env: BASE_IMAGE (default: a Debian bookworm + python3 image made here with debootstrap, kept for the next build),
# TORCH_SPEC (default torch==2.13.0, taken from /opt/wheels where it exists). Needs root, podman and debootstrap.

# base_image WORKDIR: make localhost/impala-async-base:bookworm unless BASE_IMAGE names another or it exists
base_image() {
  local work=$1
  if [ -n "${BASE_IMAGE:-}" ]; then return; fi
  BASE_IMAGE=localhost/impala-async-base:bookworm
  if ! podman image exists "$BASE_IMAGE"; then
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$work/rootfs" \
      http://deb.debian.org/debian > "$work/debootstrap.log"
    tar -C "$work/rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" > /dev/null
    rm -rf "$work/rootfs"
  fi
}

# build_image IMAGE WORKDIR: this machine's pip settings (its proxy's CA bundle, local wheels) reach the build as
# mounts only, never the image. --format docker: the OCI format has no HEALTHCHECK (podman drops it with a warning).
build_image() {
  local image=$1 work=$2 start mounts=() pip_conf="$2/pip.conf"
  base_image "$work"
  printf '[global]\n' > "$pip_conf"
  if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    mounts+=(-v /etc/ssl/certs/ca-certificates.crt:/run/host-ca.crt:ro)
    printf 'cert = /run/host-ca.crt\n' >> "$pip_conf"
  fi
  if [ -d /opt/wheels ]; then
    mounts+=(-v /opt/wheels:/opt/wheels:ro)
    printf 'find-links = /opt/wheels\n' >> "$pip_conf"
  fi
  mounts+=(-v "$pip_conf:/etc/pip.conf:ro")
  start=$(date +%s)
  podman build --format docker --isolation chroot "${mounts[@]}" --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}" -t "$image" . > "$work/build.log" 2>&1 ||
    { tail -30 "$work/build.log"; return 1; }
  BUILD_S=$(( $(date +%s) - start ))
  IMAGE_MB=$(podman image inspect "$image" --format '{{.Size}}' | awk '{printf "%.0f", $1 / 1e6}')
  echo "built $image in $BUILD_S s; size $IMAGE_MB MB"
}
