"""Large replies received into unnamed files (common/wire/filebacked.py, issue 32 item 2).

- a message decoded into a file-backed buffer has the sender's bits, leaves no file behind, and
  is never resident whole: the decoder writes the file without mapping it, and the finiteness
  check, max |t| and the fold give each piece's pages back (the mapping's resident size is read
  from /proc/self/smaps); a page given back keeps its bytes, an in-place change included;
- a corrupted frame is refused as before (CHECKSUM_MISMATCH); a folder that cannot hold the
  reply falls back to the system's temporary folder, then to memory, and a write that fails
  midway moves the message to memory with the bytes written so far;
- folding replies received into files, in shuffled arrival orders, gives the bits of today's
  id-order aggregation for FedAvg, SCAFFOLD, FedNova and FedAdam replies and edges' partials;
- a streamed run over the in-memory transport and one over real processes (gRPC) equal the
  engine (the closed form); over real processes the server's growth over the round is lower
  by about the reply it no longer holds in memory (FEDHOP_FILE_BUFFERS=0 against the default).
"""
from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.algorithms import build_algorithm
from fedhop.common.algorithms.base import WEIGHT_KEY, Payload
from fedhop.common.config import parse_config
from fedhop.common.engine.rounds import RoundEngine
from fedhop.common.processors import streaming
from fedhop.common.processors.streaming import OrderedFold
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire import filebacked
from fedhop.common.wire.codec import RECV_BUFFERS, FrameDecoder, PayloadError, encode
from fedhop.common.wire.filebacked import FileBuffers, file_backed
from fedhop.common.wire.message import CHUNK, _top, tensor_finite
from fedhop.deploy.launch.inmemory import run_inmemory
from tests.test_streaming_buffers import id_order

pytestmark = pytest.mark.skipif(not filebacked.supported(), reason="needs Linux's O_TMPFILE and madvise")

N = 3 * CHUNK + 13   # float32 elements: four pieces, the last one short


def payload(seed: int, n: int = N) -> Payload:
    g = torch.Generator().manual_seed(seed)
    return Payload(tensors={"w": torch.randn(n, generator=g), "b": torch.randint(-9, 9, (7,), dtype=torch.int8),
                            "v": torch.randn(1000, dtype=torch.float64, generator=g)},
                   scalars={WEIGHT_KEY: float(torch.rand(1, generator=g)) * 5 + 0.1})


def received(p: Payload, buffers) -> Payload:
    dec = FrameDecoder(buffers=buffers)
    for frame in encode(p, pb.Envelope(), chunk_bytes=1 << 20).frames:
        dec.feed(frame)
    return dec.finish().payload


def mapped_rss_kb(t: torch.Tensor) -> int:
    """Resident kB of the mapping whose first byte `t`'s storage starts at (/proc/self/smaps)."""
    base = t.untyped_storage().data_ptr()
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        start = line.split(" ", 1)[0].partition("-")[0]
        if "-" in line.split(" ", 1)[0] and int(start, 16) == base:
            for field in lines[i + 1:]:
                if field.startswith("Rss:"):
                    return int(field.split()[1])
    raise AssertionError(f"no mapping starts at {base:#x}")


def test_a_large_message_decodes_into_a_file_bit_for_bit_and_is_never_resident_whole(tmp_path):
    sent = payload(1)
    buffers = FileBuffers(tmp_path, 1 << 20, RECV_BUFFERS)
    got = received(sent, buffers)
    w = got.tensors["w"]
    assert buffers.made == 1 and file_backed(w) and file_backed(got.tensors["b"])
    assert not file_backed(got.tensors["v"])   # misaligned behind 7 int8 bytes: copied out (codec.py)
    assert not list(tmp_path.iterdir())   # the file has no name
    whole_kb = N * 4 // 1024
    assert mapped_rss_kb(w) < 64, "the decoder wrote the file (pwrite), mapping nothing"
    assert tensor_finite(w) and _top(w) == float(sent.tensors["w"].abs().max())
    assert mapped_rss_kb(w) < 64, "the finiteness check and max |t| read it piece by piece"
    for name, t in sent.tensors.items():
        assert torch.equal(got.tensors[name], t), name   # the pages given back kept their bytes
    assert mapped_rss_kb(w) > whole_kb // 2   # (reading it whole maps it back: the probe can tell)
    w[5] = 123.0   # an in-place change (a user's processor) survives its page being given back
    filebacked.release(w.view(-1), 0, w.numel())
    assert mapped_rss_kb(w) < 64 and float(w[5]) == 123.0 and torch.equal(w[6:], sent.tensors["w"][6:])


def test_a_corrupted_frame_in_a_file_buffer_is_refused(tmp_path):
    frames = list(encode(payload(2), pb.Envelope(), chunk_bytes=1 << 20).frames)
    bad = bytearray(frames[2])
    bad[100] ^= 1
    frames[2] = bytes(bad)
    fds = len(os.listdir("/proc/self/fd"))
    dec = FrameDecoder(buffers=FileBuffers(tmp_path, 1 << 20, RECV_BUFFERS))
    with pytest.raises(PayloadError) as exc:
        for frame in frames:
            dec.feed(frame)
        dec.finish()
    assert exc.value.code == "CHECKSUM_MISMATCH"
    assert not list(tmp_path.iterdir()) and len(os.listdir("/proc/self/fd")) == fds   # its file is gone
    cut = FrameDecoder(buffers=FileBuffers(tmp_path, 1 << 20, RECV_BUFFERS))
    for frame in frames[:3]:   # a reply cut off midway: the decoder is dropped unfinished
        cut.feed(frame)
    assert len(os.listdir("/proc/self/fd")) == fds + 1
    del cut
    assert len(os.listdir("/proc/self/fd")) == fds


def test_a_folder_that_cannot_hold_the_reply_falls_back(tmp_path, monkeypatch):
    sent = payload(3)
    elsewhere = FileBuffers(tmp_path / "missing", 1 << 20, RECV_BUFFERS)   # no such folder: the temp folder
    got = received(sent, elsewhere)
    assert elsewhere.made == 1 and file_backed(got.tensors["w"]) and torch.equal(got.tensors["w"], sent.tensors["w"])

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)   # a full disk: memory, as before
    in_memory = FileBuffers(tmp_path, 1 << 20, RECV_BUFFERS)
    got = received(sent, in_memory)
    assert in_memory.made == 0 and not file_backed(got.tensors["w"])
    assert torch.equal(got.tensors["w"], sent.tensors["w"])
    small = FileBuffers(tmp_path, 1 << 30, RECV_BUFFERS)   # below the size: memory
    assert not file_backed(received(sent, small).tensors["w"]) and small.made == 0


def test_a_write_that_fails_midway_moves_the_message_to_memory(tmp_path, monkeypatch):
    sent = payload(4)
    real, writes = os.pwrite, []

    def fills_up(fd, data, offset):
        if len(writes) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        writes.append(offset)
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", fills_up)
    buffers = FileBuffers(tmp_path, 1 << 20, RECV_BUFFERS)
    got = received(sent, buffers)
    assert buffers.made == 1 and len(writes) == 3   # three frames went to the file, the rest to memory
    assert not file_backed(got.tensors["w"])
    for name, t in sent.tensors.items():
        assert torch.equal(got.tensors[name], t), name
    assert not list(tmp_path.iterdir())

    def unreadable(fd, buffers, offset):
        raise OSError(errno.EIO, "Input/output error")

    writes.clear()
    monkeypatch.setattr(os, "preadv", unreadable)   # and the bytes written cannot be read back: a typed error
    with pytest.raises(PayloadError) as exc:
        received(sent, buffers)
    assert exc.value.code == "RECEIVE_FAILED" and "Input/output error" in str(exc.value)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_large_replies_folded_from_files_equal_id_order_and_stay_out_of_memory(tmp_path, seed):
    count = 5
    sent = [Payload(tensors={"w": p.tensors["w"], "v": p.tensors["v"]}, scalars=p.scalars)
            for p in (payload(10 * seed + i) for i in range(count))]
    order = list(range(count))
    random.Random(seed).shuffle(order)
    fold = OrderedFold(list(range(count)), {}, budget_bytes=0, spill_dir=tmp_path, file_min_bytes=1 << 20)
    for key in order:
        reply = received(sent[key], fold.receive_buffers)
        w = reply.tensors["w"]
        assert file_backed(w)
        assert fold.offer(key, reply, take=True)
        assert mapped_rss_kb(w) < 64 or key in fold._done, "folded piece by piece, or held on disk"
        del w, reply
        assert not list(tmp_path.iterdir())   # a reply held ahead of its turn stays in its unnamed file
    fold.close()
    assert fold.folded == list(range(count)) and fold.receive_buffers.made == count
    assert fold.spilled == sum(1 for i, k in enumerate(order) if k != min(order[i:]))   # ahead of their turn
    result = fold.result()
    assert result is not None
    for name, t in id_order(sent).items():
        assert torch.equal(result.tensors[name], t), name
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["fedavg", "scaffold", "fednova", "fedadam"])
@pytest.mark.parametrize("partial", [False, True], ids=["clients", "edge-partials"])
def test_replies_received_into_files_fold_to_the_id_order_aggregate(tmp_path, name, partial):
    from tests.test_streaming_aggregation import assert_same_bits, config_text, random_replies
    cfg = parse_config(config_text(name))
    algorithm = build_algorithm(cfg)
    engine = RoundEngine(cfg, algorithm=algorithm)
    rng = np.random.default_rng(7)
    ids = sorted(rng.choice(40, size=9, replace=False).tolist())
    replies = random_replies(algorithm, engine.state, ids, rng, partial)
    for trial in range(6):
        order = list(ids)
        random.Random(trial).shuffle(order)
        failed = set(random.Random(50 + trial).sample(ids, trial % 3))
        fold = OrderedFold(ids, algorithm.reply_reduce, budget_bytes=0, spill_dir=tmp_path, file_min_bytes=1)
        for k in order:
            if k in failed:
                fold.skip(k)
            else:
                assert fold.offer(k, received(replies[k], fold.receive_buffers), take=True)
        fold.close()
        kept = sorted((k, replies[k]) for k in ids if k not in failed)
        assert fold.receive_buffers.made == len(kept)
        assert_same_bits(fold.result(), algorithm.aggregate(kept))
        assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("batch", [False, True])
def test_inmemory_streamed_run_with_replies_in_files_equals_the_engine(tmp_path, monkeypatch, batch):
    """With `transport.batch` too: a request whose reply may exceed a chunk goes alone (Fabric._batches),
    so its reply still takes the fold's receive slot and goes to a file."""
    from tests.test_streaming_aggregation import large_model_config
    monkeypatch.setattr(streaming, "HOLD_FLOOR_BYTES", 1 << 20)   # 5 MB replies go to files
    text = large_model_config("files-inmemory", rounds=2, mb=5, clients=5,
                              extra=f'[transport]\nkind = "inmemory"\nbatch = {str(batch).lower()}\n')
    summary, coord = run_inmemory(parse_config(text), tmp_path)
    assert summary["status"] == "completed"
    assert summary["aggregation"]["streamed_rounds"] == 2 and summary["aggregation"]["replies_in_files"] == 10
    engine = RoundEngine(parse_config(text))
    engine.run()
    for n, t in coord.state.params.items():
        assert torch.equal(engine.state.params[n], t), n


def grpc_round(tmp_path: Path, tag: str, mb: int, clients: int, files: bool) -> dict:
    """One FedAvg round of an `mb` MB model over `clients` clients on 2 client processes, run as a
    user runs it (`fedhop run` from a folder outside the checkout); its summary.json."""
    from tests.test_streaming_aggregation import large_model_config
    work = tmp_path / tag
    work.mkdir()
    (work / "run.toml").write_text(large_model_config(
        f"files-{tag}", rounds=1, mb=mb, clients=clients, run="round_timeout = 600.0\ncall_timeout = 600.0\n"))
    # glibc returns every large block on free (deploy/launch/malloc.py keeps freed blocks for reuse), so the
    # resident size follows what is alive, not what the heap kept from before the round
    env = dict(os.environ, FEDHOP_FILE_BUFFERS="1" if files else "0", MALLOC_MMAP_THRESHOLD_="131072",
               MALLOC_TRIM_THRESHOLD_="131072", MALLOC_TOP_PAD_="0")
    done = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "run.toml", "--out", "out", "--quiet"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((work / "out" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["aggregation"]["streamed_rounds"] == 1
    w = load_file(str(work / "out" / "model.safetensors"))["w"]
    # one step of FedAvg from 0: w = lr * mean(t_i), t_i = i + 1 (deploy/bench/bench_large.py), exactly
    assert torch.equal(w, torch.full_like(w, 0.5 * (clients + 1) / 2)), "the closed form"
    return summary


def test_grpc_server_receives_large_replies_into_files_and_holds_a_model_less(tmp_path):
    mb, clients = 160, 4   # above HOLD_FLOOR_BYTES (64 MiB): every reply goes to a file
    growth, start, peak = {}, {}, {}
    for files in (False, True):
        summary = grpc_round(tmp_path, f"files-{files}", mb, clients, files)
        assert summary["aggregation"]["replies_in_files"] == (clients if files else 0)
        mem = summary["server_memory"]
        start[files], peak[files] = mem["rss_at_first_round_bytes"] / 2 ** 20, mem["peak_rss_bytes"] / 2 ** 20
        growth[files] = (mem["peak_rss_bytes"] - mem["rss_at_first_round_bytes"]) / (mb * 10 ** 6)
    print(f"server RSS growth over the round, in models: {growth[False]:.2f} in memory, {growth[True]:.2f} in files;"
          f" start {start[False]:.0f} / {start[True]:.0f} MiB, peak {peak[False]:.0f} / {peak[True]:.0f} MiB")
    # in memory the growth is the accumulator, the reply being received and gRPC's buffers
    # (about 2.2 models here); in files the reply is gone from it
    assert growth[True] < growth[False] - 0.5


def test_max_abs_read_piece_by_piece_equals_the_whole_tensors():
    t = torch.randn(3 * CHUNK + 5, dtype=torch.float32)
    assert _top(t) == max(abs(float(t.max())), abs(float(t.min())))
    t[CHUNK + 7] = float("inf")
    assert _top(t) == float("inf")
    t[2 * CHUNK + 1] = float("nan")   # as the whole tensor's max: NaN, whatever the piece before said
    assert np.isnan(_top(t))
