"""Shared test set-up: slow tests run only with FEDHOP_SLOW=1 (pyproject's pythonpath puts the repo
root on sys.path, so tests import `tests.helpers`; fedhop itself is the installed package)."""
from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("FEDHOP_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow test: set FEDHOP_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
