"""fedhop's shared layer (docs/architecture.md).

grpcio's fork handlers restart its poller thread in a child that `subprocess.Popen` forks before
it execs; with `close_fds` the child can then abort on epoll EBADF before the exec (grpcio
1.81 and later, grpc/grpc#43055), which kills a process a launcher, a test or a benchmark starts.
fedhop never uses gRPC across a fork (deploy/launch/forkstart.py forks only before grpc is imported),
so the handlers are turned off, unless the environment says otherwise, before any gRPC runs;
and fedhop's launchers start their children without a `preexec_fn` (Python then spawns them
with vfork, which runs no fork handler): a child started with FEDHOP_DIE_WITH ties its life to
the launcher here, at its first import of fedhop (common/util/procexit.py `die_with_launcher`).

gRPC core's own log is held to its errors (GRPC_VERBOSITY=ERROR unless the environment says
otherwise): by default it writes a line for every failed TLS handshake, so any peer that can
reach a port could grow a role's log without limit, past the rate limits fedhop puts on its own
refusal lines (common/transport/admission.py); the handshake is refused either way.
"""
import os

from fedhop.common.util.procexit import die_with_launcher

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
die_with_launcher()
