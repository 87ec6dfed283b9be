# calibrl retrieval service: the shared base image plus calibrl itself (no training packages).
#   scripts/build-images.sh     # builds calibrl-base:cpu first, then this image as calibrl-retrieval:cpu
#   podman build --format docker -f docker/retrieval.Dockerfile -t calibrl-retrieval:cpu .
#   GPU (unverified): BASE_IMAGE=calibrl-base:gpu (built with a CUDA TORCH_SPEC/TORCH_INDEX) and
#     --build-arg EXTRAS=gpu (faiss-gpu; the package index as the build secret pip_conf)
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

# Extras (GPU: faiss-gpu) as a requirement list of its own; empty for the CPU image.
FROM ${BASE_IMAGE} AS requirements
ARG EXTRAS=""
COPY pyproject.toml docker/requirements.py /req/
RUN python /req/requirements.py /req/pyproject.toml --only "" --extras "$EXTRAS" > /req/extras.txt

FROM ${BASE_IMAGE}
SHELL ["/bin/sh", "-euc"]
COPY requirements/lock.txt /tmp/calibrl-deps/
COPY --from=requirements /req/extras.txt /tmp/calibrl-deps/
RUN --mount=type=secret,id=pip_conf --mount=type=secret,id=ca_bundle \
    --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    if [ -s /tmp/calibrl-deps/extras.txt ]; then \
      if [ -s /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; fi; \
      if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi; \
      pip install --no-cache-dir --find-links /wheelhouse -c /tmp/calibrl-deps/lock.txt \
        -r /tmp/calibrl-deps/extras.txt; \
    fi; \
    rm -rf /tmp/calibrl-deps
COPY --from=build /install /usr/local

USER 10001
EXPOSE 50051
# The index is mounted read-only at /index (built beforehand with `calibrl index build`).
HEALTHCHECK --interval=15s --timeout=10s --start-period=120s --retries=3 \
    CMD ["calibrl", "health", "--target", "127.0.0.1:50051", "--service", "calibrl.v1.RetrievalService"]
ENTRYPOINT ["calibrl", "serve", "retrieval"]
CMD ["--index", "/index", "--port", "50051", "serving.host=0.0.0.0"]
