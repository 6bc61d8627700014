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


def pytest_collection_modifyitems(config, items):
    if os.environ.get("FEDHOP_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow test: set FEDHOP_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
