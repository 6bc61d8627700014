"""The transport benchmark keeps working (tiny mode; figures are not asserted as speeds)."""
from __future__ import annotations

import json

from deploy.bench import main


def test_bench_transport_tiny(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["transport", "--tiny", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    row = figures["rows"][0]
    assert row["size_mb"] == 1 and row["tcp_mb_s"] > 0 and row["grpc_mb_s"] > 0
    # the ledger's framed bytes for the 1 MB model: data + header frame + 5 bytes per frame
    assert 1_000_000 < row["framed_bytes"] < 1_000_000 + 2_000
    assert figures["codec"]["encode_gb_s"] > 0 and figures["fedavg_round"]["round_ms_median"] > 0
    assert "FedAvg round" in capsys.readouterr().out
