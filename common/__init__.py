"""fedhop's shared layer (docs/architecture.md).

grpcio's fork handlers restart its poller thread in a child that `subprocess.Popen` forks before
it execs; with `close_fds` the child can then abort on epoll EBADF before the exec (grpcio
1.81 and later, grpc/grpc#43055), which kills a process a launcher, a test or a benchmark starts.
fedhop never uses gRPC across a fork (deploy/forkstart.py forks only before grpc is imported),
so the handlers are turned off, unless the environment says otherwise, before any gRPC runs.
"""
import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
