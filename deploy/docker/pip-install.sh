#!/bin/sh
# fedhop-pip-install deps TORCH_REQ | project DIR: pip inside the image build (Dockerfile).
#
# With wheels in /wheels (the build's bind mount of ./wheelhouse) pip never leaves the image:
# --no-index --find-links /wheels.  With none, it uses the index the build arguments name
# (INDEX_URL, EXTRA_INDEX_URL, TRUSTED_HOST), torch from TORCH_INDEX_URL, and the CA certificate
# of the secret `pip_ca` when one is given.
#   deps: torch, then pyproject.toml's [project] dependencies less what only analysis uses
#         (matplotlib: `fedhop report`'s plots) or only the host's commands (pyyaml: `fedhop
#         compose`); MNIST comes from IDX files the user mounts under
#         data.data_dir (common/data/datasets.py `load_mnist`).
#   project: the fedhop package itself, --no-deps (they are in the layer below).
set -eu
what=$1; arg=$2
set --
if ls /wheels/*.whl >/dev/null 2>&1; then
    set -- --no-index --find-links /wheels
    torch_src=""
else
    [ -n "${INDEX_URL:-}" ] && set -- "$@" --index-url "$INDEX_URL"
    [ -n "${EXTRA_INDEX_URL:-}" ] && set -- "$@" --extra-index-url "$EXTRA_INDEX_URL"
    [ -n "${TRUSTED_HOST:-}" ] && set -- "$@" --trusted-host "$TRUSTED_HOST"
    [ -f /run/secrets/pip_ca ] && set -- "$@" --cert /run/secrets/pip_ca
    torch_src=${TORCH_INDEX_URL:-}
fi
case "$what" in
deps)
    if [ -n "$torch_src" ]; then
        pip install "$@" --index-url "$torch_src" "$arg"
    else
        pip install "$@" "$arg"
    fi
    python3 - > /tmp/requirements.txt <<'PY'
import re
import tomllib
HOST_ONLY = {"matplotlib", "pyyaml"}   # fedhop report's plots, fedhop compose's file reader: no role imports them
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() not in HOST_ONLY))
PY
    pip install "$@" -r /tmp/requirements.txt
    rm /tmp/requirements.txt
    # torch's C++ headers and test binaries serve extension builds and torch's own tests, not the
    # roles (145 MB of the CPU wheel)
    site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    rm -rf "$site/torch/include" "$site/torch/test"
    ;;
project)
    pip install "$@" --no-deps --no-compile "$arg"
    ;;
*)
    echo "fedhop-pip-install: unknown step '$what' (deps or project)" >&2
    exit 2
    ;;
esac
