# fedhop: one image for every role (server, edge, client); docker-compose.yml picks the role.
# Needs BuildKit (docker >= 23 by default; docker 20.10: DOCKER_BUILDKIT=1).
#
# Offline, from the wheelhouse that deploy/docker/wheelhouse.sh fills on the host (no network in the build):
#   deploy/docker/wheelhouse.sh && docker build -t fedhop:cpu .
# Where no registry is reachable, a Debian base first (deploy/docker/make-base.sh):
#   docker build --build-arg BASE_IMAGE=fedhop-base:bookworm -t fedhop:cpu .
# With a normal network and no wheelhouse (pip inside the build):
#   docker build --build-arg INDEX_URL=https://pypi.example/simple --build-arg TRUSTED_HOST=pypi.example \
#       --secret id=pip_ca,src=/etc/ssl/certs/my-ca.pem -t fedhop:cpu .
# CUDA image: torch from an index whose Linux wheels bundle the CUDA runtime (docker-compose.cuda.yml):
#   docker build --build-arg TORCH_INDEX_URL=https://pypi.org/simple -t fedhop:cuda .
#
# Layers: the dependencies are installed from pyproject.toml's list before any source is copied, so
# editing the source rebuilds only the last, small layers.  The image holds what the roles import
# (torch, grpc, numpy, scikit-learn's data, ...): no plotting, pandas or tensorboard.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG INDEX_URL=
ARG EXTRA_INDEX_URL=
ARG TRUSTED_HOST=

# PYTHONUNBUFFERED: logs reach `docker compose logs` line by line.  MALLOC_*: keep freed tensor
# buffers in the heap between messages (deploy/launch/malloc.py measured ~10x faster codec with them).
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MALLOC_MMAP_THRESHOLD_=268435456 \
    MALLOC_TRIM_THRESHOLD_=1073741824 \
    MALLOC_TOP_PAD_=67108864 \
    FEDHOP_RUNS=/runs \
    VIRTUAL_ENV=/opt/fedhop \
    PATH=/opt/fedhop/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

WORKDIR /app
COPY pyproject.toml ./
COPY deploy/docker/pip-install.sh /usr/local/bin/fedhop-pip-install
# The wheelhouse is mounted, not copied: its wheels never become a layer of the image.
RUN --mount=type=bind,source=wheelhouse,target=/wheels \
    --mount=type=secret,id=pip_ca \
    python3 -m venv /opt/fedhop \
    && fedhop-pip-install deps "torch==${TORCH_VERSION}" \
    && python -c "import torch, grpc, numpy, safetensors, xxhash, cryptography"

# The processes run as the unprivileged fedhop (uid 10001); the entrypoint starts as root only to
# hand it a readable copy of the TLS keys, then drops to it (deploy/docker/entrypoint.sh).
RUN useradd --create-home --uid 10001 fedhop && mkdir -p /runs && chown fedhop:fedhop /runs

COPY README.md ./
COPY docker-compose.yml ./
COPY proto ./proto
COPY api ./api
COPY common ./common
COPY client ./client
COPY edge ./edge
COPY server ./server
COPY deploy ./deploy
COPY examples ./examples
COPY topologies ./topologies
COPY transports ./transports
COPY benchmarks ./benchmarks
RUN --mount=type=bind,source=wheelhouse,target=/wheels \
    --mount=type=secret,id=pip_ca \
    fedhop-pip-install project . \
    && python -c "import fedhop.common.wire.fedhop_pb2, fedhop.deploy.launch.role" \
    && install -m 0755 deploy/docker/entrypoint.sh /usr/local/bin/fedhop-entrypoint

VOLUME ["/runs"]
EXPOSE 7000 7100 7200
ENTRYPOINT ["fedhop-entrypoint"]
CMD ["python", "-m", "fedhop.deploy.launch.role", "server", "--listen", "0.0.0.0:7000"]
