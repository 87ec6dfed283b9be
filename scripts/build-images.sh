#!/usr/bin/env bash
# Build calibrl's CPU images with podman (default when installed) or docker:
#   calibrl-base:cpu       Python, CPU torch and the shared dependencies (docker/base.Dockerfile)
#   calibrl-retrieval:cpu  calibrl-judge:cpu  calibrl-trainer:cpu   FROM calibrl-base:cpu
# Behind a package mirror or air-gapped, this machine's pip configuration and CA bundle are
# handed to the build as secrets (never written to a layer) and a local folder of wheels as
# the build context "wheelhouse" (scripts/image_build_inputs.py says what is taken and what
# is left out). Layers are cached: a rebuild after a source-only change reruns only the
# small calibrl layer of each image.
#
#   scripts/build-images.sh                    # all four, tagged :cpu
#   scripts/build-images.sh retrieval judge    # the base (cached) and those two
# Settings (environment): ENGINE=podman|docker, TAG=cpu, BASE_IMAGE=python:3.11-slim,
#   BUILD_PIP_CONF (a pip.conf), CA_BUNDLE (a PEM file), WHEELHOUSE (a folder of wheels);
#   each defaults to what this machine's pip configuration gives,
#   TORCH_SPEC, TORCH_INDEX (default: empty when the wheelhouse holds the torch wheel, else
#   the CPU wheel index), BUILD_JOBS=1. No registry reachable: scripts/build-base-image.sh
#   makes BASE_IMAGE from Debian packages first.
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE="${ENGINE:-$(command -v podman >/dev/null 2>&1 && echo podman || echo docker)}"
TAG="${TAG:-cpu}"
BASE_IMAGE="${BASE_IMAGE:-python:3.11-slim}"
BUILD_JOBS="${BUILD_JOBS:-1}"
SERVICES=("$@")
[ ${#SERVICES[@]} -gt 0 ] || SERVICES=(retrieval judge trainer)
if [ "$ENGINE" = podman ]; then . scripts/podman-env.sh; fi

secrets_dir="$(mktemp -d)"
trap 'rm -rf "$secrets_dir"' EXIT
given_pip_conf="${BUILD_PIP_CONF:-}" given_ca="${CA_BUNDLE:-}" given_wheelhouse="${WHEELHOUSE:-}"
eval "$(python3 scripts/image_build_inputs.py pip --out "$secrets_dir/pip")"
PIP_CONF="${given_pip_conf:-$PIP_CONF}"
CA_BUNDLE="${given_ca:-$CA_BUNDLE}"
WHEELHOUSE="${given_wheelhouse:-$WHEELHOUSE}"
echo "pip configuration for the build: $PIP_CONF (left out: ${DROPPED:-nothing})"
echo "CA bundle: ${CA_BUNDLE:-none}; wheelhouse: ${WHEELHOUSE:-none}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0+cpu}"
if [ -z "${TORCH_INDEX+set}" ]; then
  TORCH_INDEX=https://download.pytorch.org/whl/cpu
  torch_wheel="torch-${TORCH_SPEC#torch==}-"
  if [ -n "$WHEELHOUSE" ] && compgen -G "$WHEELHOUSE/$torch_wheel*.whl" >/dev/null; then TORCH_INDEX=""; fi
fi

common=()
if [ "$ENGINE" = podman ]; then
  # HEALTHCHECK is kept only in the docker format; --jobs: stages built at once.
  common+=(--format docker --layers --jobs "$BUILD_JOBS")
else
  export DOCKER_BUILDKIT=1
fi
common+=(--secret "id=pip_conf,src=$PIP_CONF")
[ -z "$CA_BUNDLE" ] || common+=(--secret "id=ca_bundle,src=$CA_BUNDLE")
[ -z "$WHEELHOUSE" ] || common+=(--build-context "wheelhouse=$WHEELHOUSE")

# The service images carry the digest of the tree they were built from (a test reuses images
# of the same tree). The base does not: a label there would change its id with every source
# edit, and with it the cache key of every layer built on it.
source_label=(--label "io.calibrl.source-hash=$(python3 scripts/image_build_inputs.py hash)")

build() {  # build NAME DOCKERFILE [ARGS...]
  local name="$1" dockerfile="$2" start
  shift 2
  start=$(date +%s)
  "$ENGINE" build "${common[@]}" -f "$dockerfile" -t "$name" "$@" .
  echo "built $name in $(( $(date +%s) - start )) s"
}

build "calibrl-base:$TAG" docker/base.Dockerfile --build-arg "BASE_IMAGE=$BASE_IMAGE" \
  --build-arg "TORCH_SPEC=$TORCH_SPEC" --build-arg "TORCH_INDEX=$TORCH_INDEX"
for service in "${SERVICES[@]}"; do
  build "calibrl-$service:$TAG" "docker/$service.Dockerfile" --build-arg "BASE_IMAGE=calibrl-base:$TAG" \
    "${source_label[@]}"
done
"$ENGINE" image ls --filter "reference=*calibrl-*:$TAG"
