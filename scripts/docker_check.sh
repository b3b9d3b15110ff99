#!/usr/bin/env bash
# The container path run for real (tests/deploy/test_docker_real.py): installs Docker's engine, Compose and
# debootstrap where apt-get works (root), makes a local Debian base image where no image registry is
# reachable, then builds the image and runs `docker compose up` with chat requests through both gateways.
# Minutes on a cold build; a second run reuses Docker's layer cache. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=llmpool-debian:bookworm

missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || missing+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]} (apt-get)"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
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
    nice -n 10 debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
    printf '%s\n' "deb http://deb.debian.org/debian bookworm-updates main" \
        "deb http://deb.debian.org/debian-security bookworm-security main" >>"$rootfs/etc/apt/sources.list"
    tar -C "$rootfs" -c . | docker import - "$BASE" >/dev/null
    rm -rf "$rootfs"
    echo "base image $BASE: $(( $(date +%s) - started )) s"
fi

export LLMPOOL_DOCKER_TESTS=1  # the suite leaves the module out otherwise (its budget)
exec .venv/bin/python -m pytest -s -p no:cacheprovider --durations=10 tests/deploy/test_docker_real.py "$@"
