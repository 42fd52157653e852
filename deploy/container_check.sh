#!/usr/bin/env bash
# Build the Dockerfile for real and run it: podman on a Debian root filesystem made here (no image registry),
# serve the embedded demo model, pass the image's HEALTHCHECK, answer gRPC and HTTP from outside the container,
# then stop it with SIGTERM and require exit 0 within the stop timeout (no SIGKILL).
#   bash deploy/container_check.sh [--report FILE]
# Needs root, podman, runc and mmdebstrap (.ci/run installs them: apt-get install podman runc mmdebstrap) and a
# python with logitserve's client and pip ($PYTHON, default .venv/bin/python). The base root filesystem, the
# engine's config and the wheels are cached under .container/ and deploy/wheelhouse/ (both git-ignored).
# Prints one "container_check: <step> <seconds>s" line per step and "container_check: OK" at the end.
# Env: PYTHON, DEBIAN_MIRROR (default: the host's apt source), HEALTH_TIMEOUT_S (default 300).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
CACHE=$ROOT/.container
IMAGE=localhost/logitserve:check
NAME=logitserve-check-$$
STOP_TIMEOUT=10          # podman's and docker's default: SIGTERM, then SIGKILL after this many seconds
SUITE=bookworm           # Python 3.11, as the Dockerfile's default python:3.11-slim
BASE_PACKAGES=python3,python3-venv,ca-certificates,passwd
REPORT=
while [ $# -gt 0 ]; do
  case $1 in
    --report) REPORT=$2; shift 2 ;;
    *) echo "usage: $0 [--report FILE]" >&2; exit 2 ;;
  esac
done

say() { echo "container_check: $*"; }
fail() { echo "container_check: FAILED: $*" >&2; exit 1; }
step_start() { STEP_T0=$(date +%s.%N); }
step_done() { say "$1 $(python3 -c "print(f'{$(date +%s.%N) - $STEP_T0:.1f}')")s"; }

for tool in podman runc mmdebstrap; do
  command -v $tool >/dev/null || fail "$tool is not installed (apt-get install podman runc mmdebstrap)"
done
[ "$(id -u)" = 0 ] || fail "needs root (rootful podman: rootless needs subuid ranges this check does not set up)"
mkdir -p "$CACHE"

# The engine's settings, written where CONTAINERS_CONF points (podman build and run both read it):
# - runc, not crun: crun 1.8 refuses a cgroup v1/v2 hybrid whose v2 side holds a controller (these VMs).
# - cgroupfs and file events: no systemd runs here.
# - ulimits no higher than conmon's own: rootful podman asks for nofile 1048576 and nproc 4194304, which fails
#   without CAP_SYS_RESOURCE ("setrlimit RLIMIT_NOFILE: Operation not permitted"); nproc is capped at pid_max.
nofile=$(ulimit -Hn); [ "$nofile" = unlimited ] && nofile=1048576
nproc=$(ulimit -Hu); pid_max=$(cat /proc/sys/kernel/pid_max)
{ [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ]; } && nproc=$pid_max
cat > "$CACHE/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
export CONTAINERS_CONF=$CACHE/containers.conf

# 1. The base: a minimal Debian root filesystem from Debian's packages, imported as an image (cached as a tar).
# The mirror: $DEBIAN_MIRROR, else the host's own apt source (the registry CI reaches), else deb.debian.org.
debian_mirror() {
  local m=${DEBIAN_MIRROR:-}
  [ -n "$m" ] || m=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list \
    2>/dev/null | grep -E '^(URIs:|deb )' | grep -v security | grep -oE 'https?://[^ ]+' | head -1 || true)
  echo "${m:-http://deb.debian.org/debian}"
}
step_start
key=$(echo "$SUITE $BASE_PACKAGES" | sha256sum | cut -c1-12)
BASE=localhost/logitserve-base:$SUITE-$key
tarball=$CACHE/base-$SUITE-$key.tar
if ! podman image exists "$BASE"; then
  if [ ! -s "$tarball" ]; then
    # The chroot in memory and dpkg without fsync: 30 s instead of 2 min on a busy disk; only the tar is kept.
    shm=$(df --output=avail -k /dev/shm 2>/dev/null | tail -1 || echo 0)
    [ "${shm:-0}" -gt 1048576 ] && export TMPDIR=/dev/shm
    mmdebstrap --quiet --format=tar --variant=minbase --dpkgopt=force-unsafe-io --include="$BASE_PACKAGES" \
      "$SUITE" "$tarball.part" "$(debian_mirror)" </dev/null \
      || fail "mmdebstrap could not make the $SUITE root filesystem"
    unset TMPDIR
    mv "$tarball.part" "$tarball"
  fi
  podman import --quiet "$tarball" "$BASE" >/dev/null || fail "podman import of $tarball"
fi
step_done rootfs

# 2. The wheels, on the host (the build has no index): the same torch `make install` takes, and .[server].
step_start
wkey=$(cat pyproject.toml setup.py | sha256sum | cut -c1-12)
if [ "$(cat deploy/wheelhouse/.stamp 2>/dev/null)" != "$wkey" ]; then
  "$PYTHON" -m pip download --quiet --disable-pip-version-check -d deploy/wheelhouse torch==2.13.0 ".[server]" \
    setuptools wheel grpcio-tools==1.71.0 2> >(grep -v "is ignored: it is neither" >&2) \
    || fail "pip download of the image's wheels"
  echo "$wkey" > deploy/wheelhouse/.stamp
fi
step_done wheels

# 3. The image. Docker format: OCI images have no HEALTHCHECK (podman drops it with a warning).
step_start
podman build --quiet --format docker --label org.logitserve.check=1 --build-arg BASE="$BASE" \
  --build-arg OFFLINE=1 -t "$IMAGE" . >/dev/null || fail "podman build"
podman image prune --force --filter label=org.logitserve.check=1 >/dev/null
health=$(podman image inspect "$IMAGE" \
  --format '{{if .Config.Healthcheck}}{{json .Config.Healthcheck.Test}}{{else}}none{{end}}')
[ "$health" = '["CMD","logitserve","health","127.0.0.1:50051"]' ] || fail "the image's HEALTHCHECK is $health"
step_done build

# 4. Run it on the embedded demo model with both ports published on the host's loopback.
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
GRPC_PORT=$(free_port); HTTP_PORT=$(free_port)
cleanup() { podman rm --force --time 0 "$NAME" >/dev/null 2>&1 || true; }
trap cleanup EXIT
step_start
# --health-interval disable: no systemd here to time the checks (podman logs errors trying); step 5 is the timer.
podman run --detach --name "$NAME" --health-interval disable \
  -p "127.0.0.1:$GRPC_PORT:50051" -p "127.0.0.1:$HTTP_PORT:8000" "$IMAGE" \
  serve --host 0.0.0.0 --port 50051 --http-port 8000 >/dev/null || fail "podman run"
step_done run

# 5. The HEALTHCHECK, run the way the engine runs it (inside the container, its own command and timeout).
step_start
deadline=$((SECONDS + ${HEALTH_TIMEOUT_S:-300}))
until podman healthcheck run "$NAME" >/dev/null 2>&1; do
  state=$(podman inspect --format '{{.State.Status}}' "$NAME")
  if [ "$state" != running ]; then podman logs "$NAME" >&2; fail "the container is $state before it was healthy"; fi
  if [ $SECONDS -gt $deadline ]; then
    podman logs "$NAME" >&2; fail "HEALTHCHECK still failing after ${HEALTH_TIMEOUT_S:-300} s"
  fi
  sleep 1
done
step_done health

# 6. Requests from outside: the repo's client over gRPC, and GET /v1/models over HTTP.
step_start
"$PYTHON" deploy/container_probe.py "127.0.0.1:$GRPC_PORT" "http://127.0.0.1:$HTTP_PORT" ${REPORT:+--out "$REPORT"} \
  >/dev/null || { podman logs "$NAME" >&2; fail "the requests from outside"; }
step_done requests

# 7. SIGTERM (the image's STOPSIGNAL); podman sends SIGKILL after STOP_TIMEOUT, which would show as exit 137.
step_start
podman stop --time "$STOP_TIMEOUT" "$NAME" >/dev/null
code=$(podman inspect --format '{{.State.ExitCode}}' "$NAME")
elapsed=$(python3 -c "print(f'{$(date +%s.%N) - $STEP_T0:.1f}')")
if [ "$code" != 0 ]; then podman logs "$NAME" >&2; fail "exit code $code after SIGTERM (${elapsed}s)"; fi
python3 -c "import sys; sys.exit(not $elapsed < $STOP_TIMEOUT)" \
  || fail "stop took ${elapsed}s, not under ${STOP_TIMEOUT}s"
step_done stop
say "stopped with exit 0 in ${elapsed}s (stop timeout ${STOP_TIMEOUT}s)"
say OK
