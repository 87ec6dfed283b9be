# calibrl's shared base image: Python, the CPU build of torch and every dependency the three
# images run, in two layers that all three images share (so three images cost little more
# than one). The service images (retrieval, judge, trainer) start FROM this image and add only
# calibrl itself (and the trainer its training-only packages).
#
#   scripts/build-images.sh            # builds this image and the three others (podman or docker)
#   podman build --format docker -f docker/base.Dockerfile -t localhost/calibrl-base:cpu \
#     --secret id=pip_conf,src=PIP_CONF --secret id=ca_bundle,src=CA_PEM \
#     --build-context wheelhouse=DIR .
#
# Package index configuration and CA bundle come in as build secrets, mounted for one RUN
# each and never written to a layer: pip_conf (a pip.conf: index-url, extra-index-url,
# trusted-host, proxy, credentials) and ca_bundle (a PEM file). Both are optional.
# An air-gapped build passes a folder of wheels as the build context "wheelhouse" (pip's
# --find-links); without it the empty stage below stands in.
ARG BASE_IMAGE=python:3.11-slim

FROM scratch AS wheelhouse

# The requirement list, derived from pyproject.toml in a stage of its own: the large layer
# below is keyed on this list and the lock, not on every edit of pyproject.toml.
FROM ${BASE_IMAGE} AS requirements
ARG TRAINING_ONLY=matplotlib,tensorboard
COPY pyproject.toml docker/requirements.py /req/
RUN python /req/requirements.py /req/pyproject.toml --without "$TRAINING_ONLY" > /req/base.txt

FROM ${BASE_IMAGE}

# Default: the CPU build. TORCH_INDEX is asked with a short timeout and one retry, so a build
# that cannot reach it fails within a minute; set it empty to use only the configured index and
# the wheelhouse. GPU: TORCH_SPEC=torch==2.13.0 TORCH_INDEX=https://download.pytorch.org/whl/cu126
ARG TORCH_SPEC=torch==2.13.0+cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1

SHELL ["/bin/sh", "-euc"]
WORKDIR /app
RUN useradd --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin --uid 10001 calibrl

# torch alone: the largest layer, rebuilt only when TORCH_SPEC or TORCH_INDEX changes. Headers,
# C++ test programs and protoc are dropped in the same step (no compiler runs in these images).
RUN --mount=type=secret,id=pip_conf --mount=type=secret,id=ca_bundle \
    --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    if [ -s /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; fi; \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi; \
    if [ -n "$TORCH_SPEC" ]; then \
      pip install --find-links /wheelhouse \
        ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX" --timeout 20 --retries 1} "$TORCH_SPEC"; \
    fi; \
    torch_dir="$(python -c 'import importlib.util as u; print(u.find_spec("torch").submodule_search_locations[0])')"; \
    rm -rf "$torch_dir/include" "$torch_dir"/bin/test_* "$torch_dir"/bin/*Test "$torch_dir"/bin/protoc*

# Every other dependency the images share (core dependencies only the trainer uses,
# TRAINING_ONLY, go into the trainer image), at the versions CI tested (requirements/lock.txt),
# plus setuptools for the offline install of calibrl in the images built FROM this one. Test
# suites shipped inside packages are dropped in the same step.
COPY requirements/lock.txt /tmp/calibrl-deps/
COPY --from=requirements /req/base.txt /tmp/calibrl-deps/
RUN --mount=type=secret,id=pip_conf --mount=type=secret,id=ca_bundle \
    --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    if [ -s /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; fi; \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi; \
    pip install --find-links /wheelhouse -c /tmp/calibrl-deps/lock.txt -r /tmp/calibrl-deps/base.txt setuptools; \
    site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"; \
    find "$site" -depth -type d -name tests -path '*/site-packages/*/*' -exec rm -rf {} +; \
    rm -rf /tmp/calibrl-deps
