#!/bin/bash
# deploy/docker/build.sh [TAG]: the image, built with no network (docker build --network none).
#
#   1. the wheels, from this machine's pip configuration (deploy/docker/wheelhouse.sh) into a cache
#      outside the checkout ($FEDHOP_WHEELHOUSE, else /var/cache/fedhop-deploy/wheelhouse as root,
#      else ~/.cache/fedhop/wheelhouse), linked into ./wheelhouse for the build only;
#   2. the base: $FEDHOP_BASE_IMAGE when set (e.g. python:3.11-slim-bookworm from a registry),
#      else a Debian bookworm base made with debootstrap (deploy/docker/make-base.sh);
#   3. the image TAG (default $FEDHOP_IMAGE or fedhop:cpu) with BuildKit: `docker buildx build`
#      where the CLI has buildx, else a docker 20.10-22 CLI with DOCKER_BUILDKIT=1 (Debian's
#      docker.io at /usr/bin/docker).
# Needs a running engine (DOCKER_HOST or the default socket); deploy/docker/up.sh starts one.
set -euo pipefail
cd "$(dirname "$0")/../.."
# FEDHOP_CUDA=1: the CUDA image (default tag fedhop:cuda), the same way, from a wheelhouse of its own
# holding torch's CUDA build (TORCH_INDEX_URL, default PyPI) and the NVIDIA runtime wheels
cuda=${FEDHOP_CUDA:-0}
if [ "$cuda" = 1 ]; then
    tag=${1:-${FEDHOP_IMAGE:-fedhop:cuda}}
    export TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://pypi.org/simple}
    suffix=-cuda
else
    tag=${1:-${FEDHOP_IMAGE:-fedhop:cpu}}
    suffix=
fi
# The wheels live in a cache outside the checkout; for the build they are hard-linked into
# ./wheelhouse (the Dockerfile bind-mounts it from the build context) and removed after, so the
# checkout keeps nothing.  A ./wheelhouse the user filled (`make wheelhouse`) is used as it is.
# what is built, in three steps, said as each starts: a cold machine takes minutes (the wheels
# 20-50 s, the Debian base about 3 minutes, the dependency layer 2-3 minutes), a warm one seconds
step() { echo "build.sh: [$1/3] $2 ($(( $(date +%s) - t0 )) s)" >&2; }
t0=$(date +%s)
echo "build.sh: the image $tag, offline; the first time on a machine takes about 5 minutes (wheels, a Debian base" \
     "made with debootstrap, the dependency layer), later builds seconds (all cached)" >&2
step 1 "the wheels (deploy/docker/wheelhouse.sh; cached after the first time)"
if ! ls wheelhouse/*.whl >/dev/null 2>&1; then
    if [ -n "${FEDHOP_WHEELHOUSE:-}" ]; then cache=$FEDHOP_WHEELHOUSE
    elif [ -w /var/cache ]; then cache=/var/cache/fedhop-deploy/wheelhouse$suffix
    else cache=${XDG_CACHE_HOME:-$HOME/.cache}/fedhop/wheelhouse$suffix
    fi
    # the cache holds the wheels of the requirements it was filled for (its .requirements stamp): a
    # changed dependency list (or torch source) fills in what is missing, as the first build did
    want=$(${PYTHON:-python3} -c 'import hashlib, tomllib; print(hashlib.sha256("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]).encode()).hexdigest())')
    want="$want ${TORCH_SPEC:-} ${TORCH_INDEX_URL:-}"
    if ! ls "$cache"/*.whl >/dev/null 2>&1 || [ "$(cat "$cache/.requirements" 2>/dev/null)" != "$want" ]; then
        deploy/docker/wheelhouse.sh "$cache"
        echo "$want" > "$cache/.requirements"
    fi
    mkdir -p wheelhouse
    linked=()
    for w in "$cache"/*.whl; do linked+=("wheelhouse/$(basename "$w")"); done
    trap 'rm -f "${linked[@]}"' EXIT
    cp -l "$cache"/*.whl wheelhouse/ 2>/dev/null || cp "$cache"/*.whl wheelhouse/
fi
base=${FEDHOP_BASE_IMAGE:-}
step 2 "the base image ${base:-fedhop-base:bookworm (deploy/docker/make-base.sh: debootstrap the first time)}"
if [ -z "$base" ]; then
    base=fedhop-base:bookworm
    deploy/docker/make-base.sh "$base"
fi
if docker buildx version >/dev/null 2>&1; then
    build=(docker buildx build --load)
else
    cli=docker
    case "$(docker version -f '{{.Client.Version}}' 2>/dev/null)" in 2[3-9].*|[3-9]*) cli=/usr/bin/docker ;; esac
    case "$("$cli" version -f '{{.Client.Version}}' 2>/dev/null)" in
        19.*|20.*|21.*|22.*) build=(env DOCKER_BUILDKIT=1 "$cli" build) ;;
        *) echo "build.sh: BuildKit needed: install the buildx plugin (docker-buildx-plugin / docker-buildx)" >&2; exit 2 ;;
    esac
fi
step 3 "the image's layers (docker build --network none; BuildKit's progress below)"
start=$(date +%s)
"${build[@]}" --network none --build-arg BASE_IMAGE="$base" -t "$tag" . >&2
echo "build.sh: $tag built in $(( $(date +%s) - start )) s, $(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}')" >&2
