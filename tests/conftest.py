"""Shared test set-up: slow tests run only with FEDHOP_SLOW=1 (pyproject's pythonpath puts the repo
root on sys.path, so tests import `tests.helpers`; fedhop itself is the installed package)."""
from __future__ import annotations

import os
import signal

import pytest

# A shell without job control starts a background command (`.ci/run &`, `nohup make test &`) with
# SIGINT ignored, and an ignored signal stays ignored across fork and exec: every process the tests
# start would then ignore the Ctrl-C the signal tests send it.  A handler (not SIG_IGN) is reset
# to the default in an exec'd child, so the processes the tests start get SIGINT's default again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Tests that drive one of this machine's services (the Docker engine that engine-test.sh starts and
# stops, the one-machine Slurm cluster of deploy/slurm/localcluster.sh) share one worker when the suite
# runs in parallel (`pytest -n 2 --dist loadgroup`, as `make test` does): one after another there.
HOST_SERVICE_MODULES = ("test_compose.py", "test_slurm.py")


@pytest.fixture(scope="session", autouse=True)
def grpc_stays_initialised():
    """gRPC's core shuts itself down when the last channel or server of a process is gone, on a
    thread of its own, and starts again with the next one.  Tests make and drop endpoints by the
    hundred in one worker process; one such shutdown, between two tests, aborted a worker
    (std::system_error "Resource deadlock avoided": a thread joining itself), which pytest-xdist
    did not replace, leaving the rest of the suite to one worker.  One idle channel, never
    connected, held for the whole session keeps the core initialised; a role process makes its
    endpoint once and keeps it for its life, so it never sees that cycle."""
    import grpc

    channel = grpc.insecure_channel("127.0.0.1:9")   # no call is ever made on it
    yield
    channel.close()


@pytest.fixture(autouse=True)
def plugins_unrestricted():
    """Every test starts with the process's plug-in allow-list lifted: a test that runs a role's
    set-up in the worker process (`child_setup` restricts the plug-ins, as a role process does for
    its life) left it restricted for every later test in that worker, and a test that loads a
    plug-in then failed with PLUGIN_NOT_ALLOWED depending on the order xdist dealt the tests."""
    from fedhop.common.util import plugins

    plugins.unrestricted()
    yield
    plugins.unrestricted()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in HOST_SERVICE_MODULES:
            item.add_marker(pytest.mark.xdist_group("host-services"))
    if os.environ.get("FEDHOP_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow test: set FEDHOP_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
