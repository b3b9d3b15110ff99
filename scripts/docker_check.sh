#!/usr/bin/env bash
# The container path run for real (tests/deploy/test_docker_real.py): installs Docker's engine, Compose and
# debootstrap where apt-get works (root), makes a local Debian base image where no image registry is
# reachable, then builds the image and runs `docker compose up` with chat requests through both gateways.
# Minutes on a cold build; a second run reuses Docker's layer cache. Extra arguments go to pytest.
#
#   scripts/docker_check.sh [linux/arm64|linux/amd64] [pytest arguments]
#
# A platform other than the host's builds and runs that image under qemu-user (Debian's
# qemu-user-static, registered with binfmt_misc as systemd-binfmt would): every process emulated, so
# the arm64 image on an x86 host takes about an hour cold (docs/docker.md).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=llmpool-debian:bookworm
missing=()
case "${1:-}" in
linux/*)
    export DOCKER_DEFAULT_PLATFORM=$1
    shift
    debian_arch=${DOCKER_DEFAULT_PLATFORM#linux/}
    qemu_arch=$(case $debian_arch in arm64) echo aarch64 ;; amd64) echo x86_64 ;; *) echo "$debian_arch" ;; esac)
    if [ "$qemu_arch" != "$(uname -m)" ]; then
        BASE=$BASE-$debian_arch
        command -v "qemu-$qemu_arch-static" >/dev/null 2>&1 || missing+=(qemu-user-static)
    fi
    export LLMPOOL_BASE_IMAGE=$BASE
    ;;
esac

command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || missing+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]} (apt-get)"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# A foreign platform's binaries run by qemu, inside containers too (F: the interpreter is opened now).
if [ "$BASE" != llmpool-debian:bookworm ]; then
    [ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    [ -e "/proc/sys/fs/binfmt_misc/qemu-$qemu_arch" ] ||
        cat "/usr/lib/binfmt.d/qemu-$qemu_arch.conf" >/proc/sys/fs/binfmt_misc/register
fi

# An engine: the one that answers, or dockerd started here (niced: builds and containers inherit it).
if ! docker info >/dev/null 2>&1; then
    mkdir -p test-artifacts
    setsid nice -n 10 dockerd --exec-opt native.cgroupdriver=cgroupfs >>test-artifacts/dockerd.log 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { echo "dockerd did not start: see test-artifacts/dockerd.log" >&2; exit 1; }
fi

# The base image: Docker Hub's python:3.11-slim where a registry answers, else a local Debian.
if ! docker image inspect "$BASE" >/dev/null 2>&1 && ! timeout 120 docker pull -q python:3.11-slim >/dev/null 2>&1; then
    started=$(date +%s)
    rootfs=$(mktemp -d)
    context=$(mktemp -d)
    nice -n 10 debootstrap ${debian_arch:+--arch="$debian_arch"} --variant=minbase bookworm "$rootfs" \
        http://deb.debian.org/debian >/dev/null
    printf '%s\n' "deb http://deb.debian.org/debian bookworm-updates main" \
        "deb http://deb.debian.org/debian-security bookworm-security main" >>"$rootfs/etc/apt/sources.list"
    # FROM scratch, not `docker import`: an engine without experimental features labels an imported
    # image with its own platform, whatever --platform says, and a foreign build then refuses it.
    tar -C "$rootfs" -c . >"$context/rootfs.tar"
    printf 'FROM scratch\nADD rootfs.tar /\n' >"$context/Dockerfile"
    DOCKER_BUILDKIT=0 docker build -q ${DOCKER_DEFAULT_PLATFORM:+--platform "$DOCKER_DEFAULT_PLATFORM"} -t "$BASE" "$context" >/dev/null
    rm -rf "$rootfs" "$context"
    echo "base image $BASE: $(( $(date +%s) - started )) s"
fi

export LLMPOOL_DOCKER_TESTS=1  # the suite leaves the module out otherwise (its budget)
exec .venv/bin/python -m pytest -s -p no:cacheprovider --durations=10 tests/deploy/test_docker_real.py "$@"
