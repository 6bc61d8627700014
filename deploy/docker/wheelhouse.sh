#!/bin/bash
# deploy/docker/wheelhouse.sh [DIR]: fill DIR (default ./wheelhouse) with every wheel the image
# installs, using this machine's own pip configuration (its index, local wheel folders, CA
# certificate, constraints), so that `docker build` needs no network: the Dockerfile installs
# from this folder with --no-index.
#
# Wheels for the image's Python (3.11, manylinux x86_64) are what the host's pip picks when the
# host runs CPython 3.11 on x86_64; elsewhere pass PYTHON=python3.11 of a matching machine.
# torch is the CPU build (pyproject.toml pins torch==2.13.0; TORCH_SPEC overrides it); with
# TORCH_INDEX_URL set, torch comes from that index (https://pypi.org/simple: the CUDA build, ~5.5 GB
# with its NVIDIA wheels).
set -eu
cd "$(dirname "$0")/../.."
dir=${1:-wheelhouse}
py=${PYTHON:-python3}
mkdir -p "$dir"
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
"$py" - > "$reqs" <<'PY'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))
PY
# pip's notes about the machine's file:// indexes lacking a project are noise here
download() {
    "$py" -m pip download --quiet --only-binary=:all: --dest "$dir" "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    # the CUDA image (build.sh with FEDHOP_CUDA=1): torch and the NVIDIA runtime wheels it needs from
    # an index whose Linux torch bundles CUDA (PyPI's does); the rest as usual
    torch_pin=$(grep -m1 '^torch' "$reqs")
    # this machine's pip configuration (local wheel folders holding the CPU build) is left out here
    PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= download --index-url "$TORCH_INDEX_URL" "${TORCH_SPEC:-$torch_pin}"
    grep -v '^torch' "$reqs" > "$reqs.rest" && mv "$reqs.rest" "$reqs"
    TORCH_SPEC=""
fi
download ${TORCH_SPEC:-} -r "$reqs" "setuptools>=68" wheel
echo "wheelhouse: $(ls "$dir"/*.whl | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir"
