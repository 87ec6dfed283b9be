# calibrl judge service: the shared base image plus calibrl itself (no training packages).
#   CPU (programmatic / transformers backends):
#     scripts/build-images.sh   # builds calibrl-base:cpu first, then this image as calibrl-judge:cpu
#     podman build --format docker -f docker/judge.Dockerfile -t calibrl-judge:cpu .
#   GPU (vLLM backend, unverified): build the base FROM the vLLM image, which carries a CUDA
#     build of torch and vLLM (TORCH_SPEC stays empty there), then this file FROM that base:
#     docker build -f docker/base.Dockerfile --build-arg BASE_IMAGE=vllm/vllm-openai:v0.11.0 \
#       --build-arg TORCH_SPEC= -t calibrl-base:vllm .
#     docker build -f docker/judge.Dockerfile --build-arg BASE_IMAGE=calibrl-base:vllm -t calibrl-judge .
ARG BASE_IMAGE=calibrl-base:cpu

# Build stage: calibrl installed from source, offline (its dependencies are in the base).
FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY calibrl ./calibrl
COPY retrieval_server ./retrieval_server
COPY judge_server ./judge_server
COPY trainer ./trainer
RUN pip install --no-cache-dir --no-deps --no-build-isolation --no-index --prefix /install .

FROM ${BASE_IMAGE}
COPY --from=build /install /usr/local

USER 10001
EXPOSE 50052
# Rubrics (with their validation records) are mounted read-only at /rubrics, the judge model at /models.
HEALTHCHECK --interval=15s --timeout=10s --start-period=300s --retries=3 \
    CMD ["calibrl", "health", "--target", "127.0.0.1:50052", "--service", "calibrl.v1.JudgeService"]
ENTRYPOINT ["calibrl", "serve", "judge"]
CMD ["--rubrics", "/rubrics", "--backend", "programmatic", "--port", "50052", "serving.host=0.0.0.0"]
