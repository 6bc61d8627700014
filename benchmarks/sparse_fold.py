"""The server's streaming fold of top-k uploads: by their nonzeros against decoded dense first.

One round's worth of a server's work on sparsified uploads (`[compression] up = "topk"`), done
by the code a server runs: each client's reply (a float32 model of `--mb` MB, top-k coded with
`--ratio`) goes through the inbound chain (`reply_chain`: decode, validate) into the round's
`OrderedFold`, with the server's in-memory budget for replies ahead of their turn
(`reply_budget`, spilled to a folder beyond it).  The replies arrive in reverse id order, the
worst case: every reply but the last waits for its turn.

- `sparse`: the reply chain hands the kept (indices, values) on and the fold adds them in
  place (what a server does: `reply_chain(..., folded=True)`);
- `dense`: each reply decoded into a dense model-sized tensor first (what the fold received
  before; what a collected round still does), held or spilled as such.

Each mode runs in a fresh process and reports the fold's seconds, the peak resident memory it
added (VmHWM after less VmRSS before, /proc/self/status), the bytes it held and how many
replies it spilled; the two aggregates' SHA-256 must be equal (the same bits: checked).

    python benchmarks/sparse_fold.py --mb 100 --clients 8 --ratio 0.01 --json sparse_fold.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

MB = 1_000_000


def _status() -> dict[str, int]:
    lines = Path("/proc/self/status").read_text().splitlines()
    return {k: int(v.split()[0]) * 1024 for k, _, v in (ln.partition(":") for ln in lines) if k in ("VmRSS", "VmHWM")}


def write_uploads(folder: Path, mb: float, clients: int, ratio: float) -> None:
    """Each client's coded upload (a random update, top-k coded) as a safetensors file: made in
    the parent, so a measured process never held (and freed) a model-sized update."""
    from safetensors.torch import save_file

    from fedhop.common.processors.compressors.payload import encode_payload
    from fedhop.common.processors.compressors.sparse import TopK
    from fedhop.common.wire.message import Payload

    n = int(mb * MB / 4)
    for cid in range(clients):
        g = torch.Generator().manual_seed(cid)
        coded = encode_payload(Payload(tensors={"w": torch.randn(n, generator=g)}), TopK(ratio=ratio), g, 1)
        save_file(coded.tensors, str(folder / f"client-{cid}.safetensors"))


def one_mode(mode: str, mb: float, clients: int, ratio: float, uploads: Path) -> dict:
    """The fold of the `clients` coded replies in `uploads` in this process (module docstring)."""
    from safetensors.torch import load_file

    from fedhop.common.processors.compressors.sparse import TopK
    from fedhop.common.processors.pipeline import reply_chain
    from fedhop.common.processors.streaming import OrderedFold, reply_budget
    from fedhop.common.wire.message import WEIGHT_KEY, Payload

    torch.set_num_threads(1)
    n = int(mb * MB / 4)
    spec = {"w": (torch.float32, (n,))}
    topk = TopK(ratio=ratio)
    cfg = SimpleNamespace(compression=SimpleNamespace(up="topk", params=topk, min_numel=1, error_feedback="none",
                                                      edge="none", layers={}),
                          algorithm=SimpleNamespace(compress="none"))
    coded = {cid: Payload(tensors=load_file(str(uploads / f"client-{cid}.safetensors")),
                          scalars={WEIGHT_KEY: float(10 + cid)}) for cid in range(clients)}
    with tempfile.TemporaryDirectory(prefix="fedhop-sparse-fold-") as spill:
        Path("/proc/self/clear_refs").write_text("5")   # VmHWM := VmRSS
        before = _status()["VmRSS"]
        start = time.perf_counter()
        fold = OrderedFold(list(range(clients)), {}, budget_bytes=reply_budget(spec, 1.0), spill_dir=spill)
        for cid in reversed(range(clients)):
            chain = reply_chain(cfg, spec, "train", round=1, peer=f"client-{cid}", folded=(mode == "sparse"))
            fold.offer(cid, chain(coded[cid], f"round 1 reply of client {cid}"), take=True)
        fold.close()
        result = fold.result()
        seconds = time.perf_counter() - start
        peak = _status()["VmHWM"]
    assert result is not None
    digest = hashlib.sha256(result.tensors["w"].numpy().tobytes()).hexdigest()
    upload = sum(t.numel() * t.element_size() for t in coded[0].tensors.values())
    return {"mode": mode, "mb": mb, "clients": clients, "ratio": ratio, "fold_seconds": seconds,
            "peak_added_bytes": peak - before, "peak_held_bytes": fold.peak_held_bytes, "spilled": fold.spilled,
            "sparse_tensors_folded": fold.acc.sparse_added, "upload_bytes": upload, "sha256": digest}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=100.0, help="model size in MB (float32)")
    ap.add_argument("--clients", type=int, default=8, help="replies in the round")
    ap.add_argument("--ratio", type=float, default=0.01, help="top-k's ratio (k = ceil(ratio * d))")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--mode", choices=("sparse", "dense"), help=argparse.SUPPRESS)   # one mode, in this process
    ap.add_argument("--uploads", help=argparse.SUPPRESS)                               # ... of these uploads
    args = ap.parse_args(argv)
    from fedhop.common.util.cliparser import figures_file_problem
    if problem := figures_file_problem(args.json):
        ap.error(problem)
    if args.mb <= 0 or args.clients < 1 or not 0 < args.ratio <= 1:
        print("sparse_fold: --mb > 0, --clients >= 1 and --ratio in (0, 1] please", file=sys.stderr)
        return 2
    if args.mode:
        print(json.dumps(one_mode(args.mode, args.mb, args.clients, args.ratio, Path(args.uploads))))
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedhop-sparse-uploads-") as uploads:
        write_uploads(Path(uploads), args.mb, args.clients, args.ratio)
        for mode in ("dense", "sparse"):
            out = subprocess.run([sys.executable, __file__, "--mode", mode, "--uploads", uploads, "--mb", str(args.mb),
                                  "--clients", str(args.clients), "--ratio", str(args.ratio)],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    dense, sparse = rows
    if dense["sha256"] != sparse["sha256"]:
        print("sparse_fold: the two folds' aggregates differ", file=sys.stderr)
        return 1
    print(f"top-k {args.ratio:g} of a {args.mb:g} MB model, {args.clients} replies in reverse id order "
          f"(upload {sparse['upload_bytes'] / MB:.2f} MB each); the same aggregate bits (sha256 {sparse['sha256'][:12]})")
    print(f"{'fold':>7} {'seconds':>8} {'peak added MB':>14} {'held MB':>8} {'spilled':>8} {'by nonzeros':>12}")
    for r in rows:
        print(f"{r['mode']:>7} {r['fold_seconds']:>8.2f} {r['peak_added_bytes'] / MB:>14.1f} "
              f"{r['peak_held_bytes'] / MB:>8.1f} {r['spilled']:>8} {r['sparse_tensors_folded']:>12}")
    print(f"sparse / dense: {sparse['fold_seconds'] / dense['fold_seconds']:.3f} x the time, "
          f"{sparse['peak_added_bytes'] / max(dense['peak_added_bytes'], 1):.3f} x the added peak memory")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
