"""benchmarks/message_path_speed.py (issue 49): its fold check can fail (decoded replies folded
through their flat view against the built ones), and its tiny run prints and writes a figure for
every step of a served call."""
from __future__ import annotations

import json
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = runpy.run_path(str(ROOT / "benchmarks" / "message_path_speed.py"), run_name="message_path_speed")


def test_the_fold_check_compares_bits_and_can_fail():
    built = [BENCH["w2_reply"](k) for k in range(4)]
    decoded = [BENCH["decode_frames"](BENCH["encode"](r, BENCH["make_envelope"](
        run_id="r", round=1, src="a", dst="b", method="train")).frames).payload for r in built]
    assert BENCH["same_fold"](built, decoded) == []
    nudged = [*built[:3], BENCH["Payload"](tensors={k: v.clone() for k, v in built[3].tensors.items()},
                                           scalars=dict(built[3].scalars))]
    first = next(iter(nudged[3].tensors.values()))
    first.view(-1)[0] += 1e-3   # one value of one reply
    assert BENCH["same_fold"](nudged, decoded) == ["net.0.weight"]


def test_the_tiny_run_prints_every_step(tmp_path, capsys):
    assert BENCH["main"](["--repeat", "20", "--passes", "1", "--json", str(tmp_path / "o.json")]) == 0
    out = json.loads((tmp_path / "o.json").read_text())
    steps = out["us_per_call"]
    assert set(steps) == {"make_envelope", "encode", "decode", "finite_or_raise (decoded)", "validate_reply (decoded)",
                          "fold add_if_finite (decoded)", "ledger record (JSONL)"}
    assert all(v > 0 for v in steps.values())
    assert out["per_client_us"] > steps["encode"] + steps["decode"]
    printed = capsys.readouterr().out
    assert "per sampled client" in printed and "bit for bit" in printed
