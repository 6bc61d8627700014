"""`fedhop data show CONFIG.toml`: look at a config's partition before running it.

Builds the task exactly as a run does (same seed, same partition) and prints per-client sample
counts and label histograms: summary statistics, the largest and smallest clients, and how far
each client's label mix is from the pooled one (total-variation distance, 1/2 sum_c |p_kc - p_c|).
Writes a PNG (clients x classes heat map of label shares, histogram of client sizes) unless
--no-png, and the statistics as JSON with --json.  Reading the labels of a lazily loaded data set
(femnist, shakespeare) reads every client's file once.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from fedhop.common.util.cliparser import ArgumentParser, new_file_problem


def partition_stats(sizes: np.ndarray, hist: np.ndarray | None, top: int = 5) -> dict[str, Any]:
    """Summary of client sizes (and of label histograms `hist`, clients x classes, when given)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    order = np.argsort(-sizes, kind="stable")
    out: dict[str, Any] = {
        "clients": int(len(sizes)), "samples": int(sizes.sum()),
        "size_mean": float(sizes.mean()) if len(sizes) else 0.0,
        "size_std": float(sizes.std()) if len(sizes) else 0.0,
        "size_min": int(sizes.min()) if len(sizes) else 0,
        "size_median": float(np.median(sizes)) if len(sizes) else 0.0,
        "size_max": int(sizes.max()) if len(sizes) else 0,
        "sizes": sizes.tolist(),
        "largest": [int(i) for i in order[:top]],
        "smallest": [int(i) for i in order[::-1][:top]],
    }
    if hist is not None:
        hist = np.asarray(hist, dtype=np.int64)
        present = (hist > 0).sum(axis=1)
        pooled = hist.sum(axis=0) / max(int(hist.sum()), 1)
        shares = hist / np.maximum(hist.sum(axis=1, keepdims=True), 1)
        tv = 0.5 * np.abs(shares - pooled).sum(axis=1)
        out.update({
            "classes": int(hist.shape[1]),
            "classes_per_client_mean": float(present.mean()) if len(present) else 0.0,
            "classes_per_client_min": int(present.min()) if len(present) else 0,
            "classes_per_client_max": int(present.max()) if len(present) else 0,
            "label_tv_mean": float(tv.mean()) if len(tv) else 0.0,
            "label_tv": tv.tolist(),
            "label_counts": hist.sum(axis=0).tolist(),
            "histograms": hist.tolist(),
        })
    return out


def _table(stats: dict[str, Any], hist: np.ndarray | None) -> str:
    lines = [f"clients {stats['clients']}, samples {stats['samples']}",
             f"samples per client: mean {stats['size_mean']:.1f}, std {stats['size_std']:.1f}, min {stats['size_min']}, "
             f"median {stats['size_median']:.1f}, max {stats['size_max']}"]
    if hist is not None:
        lines.append(f"classes {stats['classes']}; classes per client: mean {stats['classes_per_client_mean']:.1f}, "
                     f"min {stats['classes_per_client_min']}, max {stats['classes_per_client_max']}; label "
                     f"distance to the pooled mix (TV): mean {stats['label_tv_mean']:.3f}")
    sizes = stats["sizes"]
    for title, ids in (("largest", stats["largest"]), ("smallest", stats["smallest"])):
        lines.append(f"{title} clients:")
        for i in ids:
            row = f"  client {i:>6}  {sizes[i]:>7} samples"
            if hist is not None:
                h = hist[i]
                top = np.argsort(-h, kind="stable")[:3]
                mix = ", ".join(f"{int(c)}:{int(h[c])}" for c in top if h[c] > 0)
                row += f"  {int((h > 0).sum()):>3} classes  TV {stats['label_tv'][i]:.3f}  top labels {mix}"
            lines.append(row)
    return "\n".join(lines)


def write_png(path: Path, stats: dict[str, Any], hist: np.ndarray | None, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n_plots = 2 if hist is not None else 1
    fig, axes = plt.subplots(1, n_plots, figsize=(6 * n_plots, 4.5), squeeze=False)
    if hist is not None:
        shares = hist / np.maximum(hist.sum(axis=1, keepdims=True), 1)
        ax = axes[0][0]
        im = ax.imshow(shares, aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set_xlabel("class")
        ax.set_ylabel("client")
        ax.set_title("label share per client")
        fig.colorbar(im, ax=ax)
    ax = axes[0][-1]
    ax.hist(stats["sizes"], bins=min(50, max(5, stats["clients"] // 2)))
    ax.set_xlabel("samples per client")
    ax.set_ylabel("clients")
    ax.set_title("client sizes")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def output_problem(config: str, png: str | None, json_out: str | None, force: bool) -> str | None:
    """Why `show` cannot write its --png and --json files (cliparser `new_file_problem`), checked before
    any work; the config it reads is never one of them, even with --force."""
    for flag, path, suffix in (("--png", png, ".png"), ("--json", json_out, ".json")):
        if not path:
            continue
        if Path(path).resolve() == Path(config).resolve():
            return f"{flag} {path}: the config being read; name another file"
        problem = new_file_problem(path, flag, suffix, force)
        if problem:
            return problem
    return None


def show(config: str, overrides: list[str], png: str | None, json_out: str | None, top: int,
         force: bool = False) -> int:
    from fedhop.common.config import ConfigError, load_config
    from fedhop.common.tasks import build_task
    problem = output_problem(config, png, json_out, force)
    if problem:
        print(f"fedhop data show: {problem}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(config, overrides)
    except (ConfigError, OSError) as exc:
        print(f"fedhop data show: {exc}", file=sys.stderr)
        return 2
    try:
        task = build_task(cfg)
        sizes = np.array([task.num_samples(c) for c in range(task.num_clients)], dtype=np.int64)
        hist = np.asarray(task.label_histograms(), dtype=np.int64) if hasattr(task, "label_histograms") else None
    except (OSError, ValueError) as exc:
        print(f"fedhop data show: {exc}", file=sys.stderr)
        return 2
    stats = partition_stats(sizes, hist, top)
    stats["dataset"], stats["partition"] = cfg.data.dataset, cfg.data.partition
    title = f"{cfg.data.dataset}, partition {cfg.data.partition}, {stats['clients']} clients"
    print(title)
    print(_table(stats, hist))
    if json_out:
        Path(json_out).write_text(json.dumps(stats))
    if png:
        try:
            write_png(Path(png), stats, hist, title)
        except ImportError:
            print("fedhop data show: no PNG: matplotlib is not installed (pip install 'fedhop[report]')",
                  file=sys.stderr)
            return 0
        print(f"wrote {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="fedhop data", description="look at a config's data and partition")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("show", help="per-client sample counts and label histograms, and a PNG of them")
    s.add_argument("config", help="experiment TOML file")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key (repeatable)")
    s.add_argument("--png", default="partition.png", help="the PNG to write (default partition.png); an existing "
                                                          "file is refused unless --force")
    s.add_argument("--no-png", action="store_true", help="write no PNG")
    s.add_argument("--json", help="also write the statistics as JSON to this .json file; an existing file is "
                                  "refused unless --force")
    s.add_argument("--force", action="store_true", help="replace an existing --png or --json file (never the "
                                                         "config being read)")
    s.add_argument("--top", type=int, default=5, help="how many largest and smallest clients to list")
    args = ap.parse_args(argv)
    return show(args.config, args.overrides, None if args.no_png else args.png, args.json, max(0, args.top),
                args.force)


if __name__ == "__main__":
    sys.exit(main())
