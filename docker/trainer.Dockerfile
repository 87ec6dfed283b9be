# calibrl trainer (a client of both services).
#   CPU: docker build -f docker/trainer.Dockerfile -t calibrl-trainer .
#   GPU: --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126 [--build-arg EXTRAS=gpu]
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS="lora"

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
    && useradd --create-home --uid 10001 calibrl \
    && mkdir -p /runs && chown calibrl /runs

USER 10001
# The policy is mounted read-only at /models/policy, the config at /etc/calibrl/train.yaml,
# checkpoints and logs go to the /runs volume. Multi-GPU: override the entrypoint with
#   torchrun --nproc_per_node N -m calibrl.cli train --config ...
ENTRYPOINT ["calibrl", "train"]
CMD ["--config", "/etc/calibrl/train.yaml"]
