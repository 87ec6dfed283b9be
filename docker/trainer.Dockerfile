# calibrl trainer (a client of both services): the shared base image plus the training-only
# packages (plots, TensorBoard, LoRA) and calibrl itself.
#   scripts/build-images.sh     # builds calibrl-base:cpu first, then this image as calibrl-trainer:cpu
#   podman build --format docker -f docker/trainer.Dockerfile -t calibrl-trainer:cpu \
#     --secret id=pip_conf,src=PIP_CONF --secret id=ca_bundle,src=CA_PEM .
#   GPU (unverified): BASE_IMAGE=calibrl-base:gpu (built with a CUDA TORCH_SPEC/TORCH_INDEX)
ARG BASE_IMAGE=calibrl-base:cpu

FROM scratch AS wheelhouse

# Build stage: calibrl installed from source, offline (its dependencies are in the base).
FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY calibrl ./calibrl
COPY retrieval_server ./retrieval_server
COPY judge_server ./judge_server
COPY trainer ./trainer
RUN pip install --no-cache-dir --no-deps --no-build-isolation --no-index --prefix /install .

# The core dependencies the base leaves out (see base.Dockerfile) and the extras, as a
# requirement list of its own (the install below reruns only when this list or the lock changes).
FROM ${BASE_IMAGE} AS requirements
ARG TRAINING_ONLY=matplotlib,tensorboard
ARG EXTRAS=lora
COPY pyproject.toml docker/requirements.py /req/
RUN python /req/requirements.py /req/pyproject.toml --only "$TRAINING_ONLY" --extras "$EXTRAS" > /req/training.txt

FROM ${BASE_IMAGE}
SHELL ["/bin/sh", "-euc"]
COPY requirements/lock.txt /tmp/calibrl-deps/
COPY --from=requirements /req/training.txt /tmp/calibrl-deps/
RUN --mount=type=secret,id=pip_conf --mount=type=secret,id=ca_bundle \
    --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    if [ -s /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; fi; \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi; \
    pip install --no-cache-dir --find-links /wheelhouse -c /tmp/calibrl-deps/lock.txt \
      -r /tmp/calibrl-deps/training.txt; \
    site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"; \
    find "$site" -depth -type d -name tests -path '*/site-packages/*/*' -exec rm -rf {} +; \
    rm -rf /tmp/calibrl-deps; \
    mkdir -p /runs; chown 10001:10001 /runs
COPY --from=build /install /usr/local

USER 10001
# The policy is mounted read-only at /models/policy, the config at /etc/calibrl/train.yaml,
# checkpoints and logs go to the /runs volume. Multi-GPU: override the entrypoint with
#   torchrun --nproc_per_node N -m calibrl.cli train --config ...
ENTRYPOINT ["calibrl", "train"]
CMD ["--config", "/etc/calibrl/train.yaml"]
