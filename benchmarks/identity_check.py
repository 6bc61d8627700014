"""Are the examples' final models the same bit for bit under two installs? (docs/performance.md)

    python benchmarks/identity_check.py FEDHOP [--rounds 3] [--only NAME ...] [--keep DIR]

Runs the 9 configurations a restructure is checked on (fedavg, hierfavg, fedchs and gossip on
digits; the fedavg example as a chain and as a relay; fedavg, hierfavg and fedchs over
torch.distributed), each for `--rounds` rounds, with the `fedhop` executable FEDHOP, and prints
one line per configuration on stdout: its name, the SHA-256 of the final model's tensors and
their count (each run's wall time goes to stderr, so two outputs compare with diff).  Run it once
with the install before a change and once with the install after it; equal lines mean
bit-identical models.

Why it is shaped this way:
- FEDHOP is an argument, so one script drives two installs (two worktrees, two virtualenvs);
  each run starts in a temporary folder outside any checkout, so the repository root on the
  current directory cannot put one tree's code in front of the other's installed package.
- The configs come from one examples folder (default: this checkout's examples/) for both
  installs, so the two runs read the same input files.
- The hash covers the tensors only (name, dtype, shape and raw little-endian bytes, in sorted name
  order), not the file: a safetensors file's header layout and metadata may change without the
  model changing.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]

# name -> (example file, --set overrides).  The set of issue 27's check (docs/performance.md,
# "Before and after the layered restructure").
CONFIGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "fedavg": ("fedavg_digits.toml", ()),
    "hierfavg": ("hierfavg_digits.toml", ()),
    "fedchs": ("fedchs_digits.toml", ()),
    "gossip": ("gossip_digits.toml", ()),
    "chain": ("fedavg_digits.toml", ("topology.kind=chain",)),
    "relay": ("fedavg_digits.toml", ("topology.kind=relay",)),
    "fedavg-torch": ("fedavg_digits.toml", ("transport.kind=torch",)),
    "hierfavg-torch": ("hierfavg_digits.toml", ("transport.kind=torch",)),
    "fedchs-torch": ("fedchs_digits.toml", ("transport.kind=torch",)),
}


def tensor_hash(path: Path) -> tuple[str, int]:
    """SHA-256 over every tensor of a safetensors file in sorted name order, and the tensor count.

    Each tensor contributes its name, dtype and shape (so a renamed or reshaped tensor with the
    same bytes still differs) and then its raw bytes.
    """
    digest = hashlib.sha256()
    with safe_open(str(path), framework="numpy") as handle:
        names = sorted(handle.keys())
        for name in names:
            array = handle.get_tensor(name)
            digest.update(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode())
            digest.update(array.tobytes(order="C"))
    return digest.hexdigest(), len(names)


def run_one(fedhop: str, config: Path, overrides: tuple[str, ...], rounds: int, workdir: Path,
            out: str, timeout: float) -> Path:
    """Run one configuration in `workdir` and return its final model file."""
    command = [fedhop, "run", str(config), "--quiet", "--out", out, "--set", f"run.rounds={rounds}"]
    for override in overrides:
        command += ["--set", override]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}:\n{result.stdout}{result.stderr}")
    model = workdir / out / "model.safetensors"
    if not model.is_file():
        raise RuntimeError(f"{' '.join(command)} left no {model}")
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fedhop", help="the fedhop executable of the install to check")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=sorted(CONFIGS), help="these configurations only")
    parser.add_argument("--examples", type=Path, default=ROOT / "examples",
                        help="folder of the example configs (default: this checkout's examples/)")
    parser.add_argument("--keep", type=Path, help="keep the run folders under this folder")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    args = parser.parse_args(argv)
    fedhop = shutil.which(args.fedhop) or args.fedhop
    if not os.access(fedhop, os.X_OK):
        print(f"identity_check: {args.fedhop} is not an executable", file=sys.stderr)
        return 2
    names = args.only or list(CONFIGS)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        workdir = args.keep.resolve()
        scratch = None
    else:
        scratch = tempfile.TemporaryDirectory(prefix="fedhop-identity-")
        workdir = Path(scratch.name)
    try:
        for name in names:
            example, overrides = CONFIGS[name]
            started = time.monotonic()
            model = run_one(fedhop, (args.examples / example).resolve(), overrides, args.rounds, workdir,
                            name, args.timeout)
            digest, count = tensor_hash(model)
            print(f"{name:<15} {digest}  tensors={count}", flush=True)
            print(f"identity_check: {name} took {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    finally:
        if scratch is not None:
            scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
