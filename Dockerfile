# fedhop: one image for every role (server, edge, client); docker-compose.yml picks the role.
#
#   docker compose build                                   # CPU image (torch 2.13.0+cpu), tag fedhop:cpu
#   docker compose -f docker-compose.yml -f docker-compose.cuda.yml build     # CUDA image, tag fedhop:cuda
#   docker build --build-arg TORCH_INDEX_URL=https://pypi.org/simple -t fedhop:cuda .   # the same by hand
#
# The CUDA build only changes where torch comes from: PyPI's Linux torch wheels bundle the CUDA
# runtime (nvidia-* wheels), so the base image stays python:3.11-slim and the host needs only the
# NVIDIA driver and container toolkit.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# PYTHONUNBUFFERED: logs reach `docker compose logs` line by line.  MALLOC_*: keep freed tensor
# buffers in the heap between messages (deploy/malloc.py measured ~10x faster codec with them).
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MALLOC_MMAP_THRESHOLD_=268435456 \
    MALLOC_TRIM_THRESHOLD_=1073741824 \
    MALLOC_TOP_PAD_=67108864 \
    FEDHOP_RUNS=/runs

WORKDIR /app

# torch first, from the index that decides CPU or CUDA; `pip install .` then finds its pin satisfied
# (2.13.0+cpu satisfies torch==2.13.0).
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

COPY pyproject.toml README.md ./
COPY proto ./proto
COPY common ./common
COPY client ./client
COPY edge ./edge
COPY server ./server
COPY deploy ./deploy
COPY examples ./examples
RUN pip install . && python -c "import torch, grpc, fedhop.common.wire.fedhop_pb2"

# an unprivileged user owns the run volume (a new named volume takes the ownership of /runs)
RUN useradd --create-home --uid 10001 fedhop && mkdir -p /runs && chown fedhop:fedhop /runs
USER fedhop
VOLUME ["/runs"]
EXPOSE 7000 7100 7200

CMD ["python", "-m", "fedhop.deploy.role", "server", "--listen", "0.0.0.0:7000"]
