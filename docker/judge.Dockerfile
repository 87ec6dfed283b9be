# calibrl judge service.
#   GPU (vLLM backend, default): docker build -f docker/judge.Dockerfile -t calibrl-judge .
#   CPU (programmatic / transformers backends):
#     docker build -f docker/judge.Dockerfile --build-arg BASE_IMAGE=python:3.11-slim \
#       --build-arg TORCH_SPEC=torch==2.13.0 --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu \
#       -t calibrl-judge:cpu .
# The vLLM image already carries a CUDA build of torch and vLLM; TORCH_SPEC stays empty there.
ARG BASE_IMAGE=vllm/vllm-openai:v0.11.0
FROM ${BASE_IMAGE}

ARG TORCH_SPEC=""
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1

WORKDIR /app
RUN if [ -n "${TORCH_SPEC}" ]; then pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"; fi
COPY pyproject.toml README.md ./
COPY calibrl ./calibrl
COPY retrieval_server ./retrieval_server
COPY judge_server ./judge_server
COPY trainer ./trainer
RUN pip install . \
    && (id -u calibrl >/dev/null 2>&1 || useradd --create-home --uid 10001 calibrl)

USER 10001
EXPOSE 50052
# Rubrics (with their validation records) are mounted read-only at /rubrics, the judge model at /models.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["calibrl", "health", "--target", "127.0.0.1:50052", "--service", "calibrl.v1.JudgeService"]
ENTRYPOINT ["calibrl", "serve", "judge"]
CMD ["--rubrics", "/rubrics", "--backend", "programmatic", "--port", "50052", "serving.host=0.0.0.0"]
