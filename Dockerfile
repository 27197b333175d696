# impala-async in a container: the learner and its local actors, on a GPU workstation or any Linux box.
#
#   docker build -t impala-async .
#   docker run --rm --gpus all --stop-timeout 30 -v "$PWD/runs:/data/runs" impala-async train --env CartPole-v1
#
# torch: PyPI's default build for the platform (on x86_64 a CUDA build that bundles the CUDA runtime, so the host
# needs only its NVIDIA driver and the NVIDIA container toolkit). Pick another with build arguments, e.g.
#   --build-arg TORCH_SPEC=torch==2.6.0 --build-arg PIP_ARGS="--index-url https://download.pytorch.org/whl/cu124"
# BASE_IMAGE may be any Debian-like image with python3 (>= 3.10) and its venv module.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_SPEC="torch>=2.6"
ARG PIP_ARGS=""
ARG EXTRAS="atari"

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# torch alone first: the largest layer, kept in the build cache across code changes.
RUN python3 -m venv /opt/venv && pip install $PIP_ARGS "$TORCH_SPEC"

WORKDIR /opt/impala-async
COPY pyproject.toml README.md ./
COPY impala_async ./impala_async
COPY tools ./tools
COPY docs ./docs
RUN pip install $PIP_ARGS ".[$EXTRAS]" \
 && python -c "import impala_async.cli, impala_async.learner.server, impala_async.actors.actor" \
 && impala-async --help > /dev/null

# Not root. Runs, checkpoints and metrics go to /data/runs (mount it); CURVE keys are read from wherever
# --curve-keys points (mount them read-only, e.g. -v "$PWD/keys/learner:/keys:ro").
RUN useradd --create-home --uid 1000 impala && mkdir -p /data/runs && chown -R impala /data
USER impala
WORKDIR /data

# Trajectories in, weights out (impala-async learner's defaults). `train` binds loopback ports for its own actors
# unless given --listen/--publish; a non-loopback address needs --curve-keys (or --insecure 1).
EXPOSE 5555 5556

# /metrics and /healthz (README, Operations): every learner, `train` or actor supervisor in the container serves them
# on 127.0.0.1:9481 inside it (plain HTTP, so loopback unless --metrics-host says otherwise; publishing it needs
# --metrics-host 0.0.0.0 and `-p 127.0.0.1:9481:9481`). IMPALA_ASYNC_METRICS_PORT=0 turns it off.
ENV IMPALA_ASYNC_METRICS_PORT=9481
EXPOSE 9481
# `impala-async healthcheck` GETs /healthz on that port: exit 0 on 200, 1 otherwise (no curl in the image). The
# start period covers interpreter start, torch import and the actors' first heartbeats.
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 CMD ["impala-async", "healthcheck"]

# SIGINT and SIGTERM both make the learner stop intake, write a final checkpoint, stop its actors and exit 0
# within --shutdown-timeout-s (10 s by default); give `docker stop` more than that (--stop-timeout 30).
STOPSIGNAL SIGTERM
ENTRYPOINT ["impala-async"]
CMD ["train", "--env", "CartPole-v1"]
