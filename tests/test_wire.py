"""The committed generated protobuf code equals a fresh generation from proto/fedhop.proto."""
from __future__ import annotations

from pathlib import Path

import pytest

from fedhop.common.wire import generate


def test_generated_code_is_fresh(tmp_path: Path):
    pytest.importorskip("grpc_tools")
    for fresh in generate.generate(tmp_path):
        committed = generate.WIRE / fresh.name
        assert committed.read_text() == fresh.read_text(), f"{committed} is stale: run python -m fedhop.common.wire.generate"
