# calibrl retrieval service.
#   docker build -f docker/retrieval.Dockerfile -t calibrl-retrieval .
#   GPU (faiss-gpu + CUDA torch): --build-arg EXTRAS=gpu --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1

WORKDIR /app
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY calibrl ./calibrl
COPY retrieval_server ./retrieval_server
COPY judge_server ./judge_server
COPY trainer ./trainer
RUN pip install ".${EXTRAS:+[$EXTRAS]}" \
    && useradd --create-home --uid 10001 calibrl

USER 10001
EXPOSE 50051
# The index is mounted read-only at /index (built beforehand with `calibrl index build`).
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["calibrl", "health", "--target", "127.0.0.1:50051", "--service", "calibrl.v1.RetrievalService"]
ENTRYPOINT ["calibrl", "serve", "retrieval"]
CMD ["--index", "/index", "--port", "50051", "serving.host=0.0.0.0"]
