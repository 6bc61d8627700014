"""benchmarks/identity_check.py on one cheap configuration (the chain, 1 round) with the current
install: it prints one 64-hex SHA-256 per configuration, and that hash equals one computed here
independently from the safetensors file's own layout (8-byte header length, JSON header, data
offsets); one changed byte of a tensor changes it."""
from __future__ import annotations

import hashlib
import json
import re
import runpy
import shutil
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUMPY_DTYPE = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "I64": "<i8", "I32": "<i4"}


def file_hash(path: Path) -> str:
    """The script's hash, read without safetensors: name, dtype, shape, raw bytes per tensor."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    data = raw[8 + length:]
    digest = hashlib.sha256()
    for name in sorted(key for key in header if key != "__metadata__"):
        entry = header[name]
        start, end = entry["data_offsets"]
        digest.update(f"{name}\0{NUMPY_DTYPE[entry['dtype']]}\0{tuple(entry['shape'])}\0".encode())
        digest.update(data[start:end])
    return digest.hexdigest()


def test_identity_check_one_config(tmp_path, capsys):
    script = runpy.run_path(str(ROOT / "benchmarks" / "identity_check.py"), run_name="identity_check")
    fedhop = str(Path(sys.executable).parent / "fedhop")
    assert script["main"]([fedhop, "--only", "chain", "--rounds", "1", "--keep", str(tmp_path / "runs"),
                           "--timeout", "120"]) == 0
    line = capsys.readouterr().out.strip()
    match = re.fullmatch(r"chain +([0-9a-f]{64})  tensors=(\d+)", line)
    assert match, line
    model = tmp_path / "runs" / "chain" / "model.safetensors"
    assert match.group(1) == file_hash(model)
    assert int(match.group(2)) == 4            # the digits MLP: two weights, two biases

    changed = tmp_path / "changed.safetensors"
    shutil.copyfile(model, changed)
    raw = bytearray(changed.read_bytes())
    raw[-1] ^= 1                                # the last byte belongs to the last tensor
    changed.write_bytes(bytes(raw))
    assert script["tensor_hash"](changed)[0] != match.group(1)
