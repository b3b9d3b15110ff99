# `docker buildx bake`: the image for both platforms, each with the kernels of every instruction set of its
# architecture (amd64: avx512, avxvnni, avx2, portable; arm64: neon_i8mm, neon, portable), picked by the worker at start.
# One platform: `docker buildx bake --set llmpool.platform=linux/arm64 --load`.
variable "TAG" { default = "llmpool:latest" }
variable "BASE_IMAGE" { default = "python:3.11-slim" }

group "default" { targets = ["llmpool"] }

target "llmpool" {
  context = "."
  dockerfile = "Dockerfile"
  tags = ["${TAG}"]
  platforms = ["linux/amd64", "linux/arm64"]
  args = { BASE_IMAGE = "${BASE_IMAGE}", TORCH_VARIANT = "cpu" }
}
