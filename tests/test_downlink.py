"""Coded broadcasts, `[compression] down` (common/processors/compressors/downlink.py,
docs/compression.md "Downlink"): every receiver ends each round with the server's reference model
bit for bit, whichever rounds it skipped; the reference equals an independent numpy replay of
x_hat <- x_hat + topk(b - x_hat); every message's bytes are the coded differences it carries (or
the plain model: a resync); a participant's bad input is a typed error, never a crash.
"""
from __future__ import annotations

import json
import math
import sqlite3
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.config import ConfigError, parse_config
from fedhop.common.engine.rounds import RoundEngine
from fedhop.common.processors.compressors.downlink import (
    BASE_KEY,
    VERSION_KEY,
    DownlinkCoding,
    DownlinkReceiver,
    DownlinkSender,
    part_name,
)
from fedhop.common.processors.compressors.sparse import TopK
from fedhop.common.records.checkpoint import list_checkpoints, load_checkpoint
from fedhop.common.topologies.plan import plan_processes
from fedhop.common.wire.codec import PayloadError, decode_frames, encode, make_envelope
from fedhop.common.wire.message import Payload
from fedhop.deploy.launch.launcher import resume_local, run_local

K = 20   # top-k's elements kept per tensor (k fixed, so the numpy replay needs no rounding rule)


def wire(message: Payload) -> Payload:
    """The message as a receiver decodes it from its frames."""
    env = make_envelope(run_id="r", round=1, src="server", dst="client-0", method="train")
    return decode_frames(encode(message, env).frames).payload


def np_topk(v: np.ndarray, k: int) -> np.ndarray:
    """Keep the k largest |v_i| (no ties: continuous random values), zero the rest."""
    flat, out = v.reshape(-1), np.zeros(v.size, dtype=v.dtype)
    keep = np.argsort(-np.abs(flat), kind="stable")[:k]
    out[keep] = flat[keep]
    return out.reshape(v.shape)


def np_topk_bytes(d: int, kept: np.ndarray) -> int:
    """float32 values and the smallest index format: min(4 k, LEB128 of the gaps, ceil(d / 8))."""
    idx = sorted(int(i) for i in np.flatnonzero(kept))
    prev, varint = -1, 0
    for i in idx:
        t = i - prev - 1
        prev = i
        varint += max(1, math.ceil(t.bit_length() / 7))
    return 4 * len(idx) + min(4 * len(idx), varint, math.ceil(d / 8))


def broadcasts(rounds: int, seed: int = 0):
    """A model drifting round by round (two coded tensors), and two tensors that travel plain
    (an integer counter, a 1-element tensor below min_numel)."""
    rng = np.random.default_rng(seed)
    w, b = rng.normal(size=(30, 20)).astype(np.float32), rng.normal(size=40).astype(np.float32)
    for r in range(1, rounds + 1):
        w = (w + rng.normal(scale=0.1, size=w.shape)).astype(np.float32)
        b = (b + rng.normal(scale=0.1, size=b.shape)).astype(np.float32)
        yield Payload(tensors={"w": torch.from_numpy(w.copy()), "b": torch.from_numpy(b.copy()),
                               "count": torch.tensor([r], dtype=torch.int64), "s": torch.tensor([0.5 * r])},
                      scalars={"lr": 0.1})


def coding() -> DownlinkCoding:
    return DownlinkCoding(TopK(k=K), min_numel=2)


def test_every_receiver_holds_the_reference_bit_for_bit_whatever_rounds_it_skipped():
    """Six receivers sampled with different odds for 60 rounds, some failing to answer: each
    message, through the codec, gives its receiver the server's reference, which equals numpy's
    replay; a coded message carries exactly the versions its receiver missed, each of the bytes
    numpy's top-k keeps; a resync carries the plain model."""
    rounds, odds = 60, [1.0, 0.8, 0.5, 0.3, 0.1, 0.03]
    sender = DownlinkSender(coding(), seed=7, extra=lambda: extra)
    extra: dict[str, torch.Tensor] = {}
    receivers = [DownlinkReceiver(coding()) for _ in odds]
    rng = np.random.default_rng(1)
    ref: dict[str, np.ndarray] = {}
    coded_bytes: dict[int, int] = {}   # version -> bytes of its coded difference (numpy's count)
    kinds = {"initial": 0, "next": 0, "catch-up": 0, "resync": 0}
    for r, message in enumerate(broadcasts(rounds), start=1):
        for_receiver = sender.code(message)
        if r == 1:   # the first broadcast is the reference
            ref = {n: message.tensors[n].numpy().copy() for n in ("w", "b")}
        else:
            size = 0
            for n in ("w", "b"):
                kept = np_topk(message.tensors[n].numpy() - ref[n], K)
                ref[n] = (ref[n] + kept).astype(np.float32)
                size += np_topk_bytes(ref[n].size, kept)
            coded_bytes[r] = size
        for n in ("w", "b"):
            assert np.array_equal(sender.reference()[n].numpy(), ref[n]), (r, n)
        answered: dict[str, bool] = {}
        for i, (receiver, p) in enumerate(zip(receivers, odds)):
            if rng.random() >= p:
                continue
            held = sender.holds.get(f"p{i}")
            sent = for_receiver(f"p{i}")
            got = receiver.receive(wire(sent), f"p{i}")
            for n in ("w", "b"):
                assert torch.equal(got.tensors[n], sender.reference()[n]), (r, i, n)
            assert torch.equal(got.tensors["count"], message.tensors["count"])
            assert torch.equal(got.tensors["s"], message.tensors["s"])
            assert got.scalars == {"lr": 0.1}   # the downlink's scalars are the receiver's own
            plain = 4 * (600 + 40) + 8 + 4
            tensor_bytes = sent.tensor_bytes()
            if BASE_KEY not in sent.scalars:
                kinds["initial" if r == 1 else "resync"] += 1
                assert tensor_bytes == plain
            else:
                base = sent.scalars[BASE_KEY]
                assert base == held and sent.scalars[VERSION_KEY] == r
                kinds["next" if base == r - 1 else "catch-up"] += 1
                assert tensor_bytes == sum(coded_bytes[v] for v in range(base + 1, r + 1)) + 8 + 4
            answered[f"p{i}"] = rng.random() > 0.1   # one call in ten fails after the receiver took it
        sender.delivered(answered)
        kept = [v for v, _, _ in sender.history]
        assert sum(coded_bytes[v] for v in kept) < 4 * 640   # differences kept while they cost less than the model
        assert not kept or kept == list(range(kept[0], r + 1))
    assert all(kinds.values()), kinds   # every path taken


def test_a_receiver_behind_the_kept_differences_gets_a_resync():
    sender = DownlinkSender(coding(), seed=1, extra=lambda: extra)
    extra: dict[str, torch.Tensor] = {}
    stream = broadcasts(40, seed=3)
    sender.code(next(stream))
    sender.delivered({"late": True, "often": True})
    rounds_kept = 0
    for r, message in enumerate(stream, start=2):
        for_receiver = sender.code(message)
        oldest = sender.history[0][0]
        sent_late = for_receiver("late")
        assert (BASE_KEY in sent_late.scalars) == (oldest <= 2), (r, oldest)   # "late" holds version 1
        if BASE_KEY in sent_late.scalars:
            rounds_kept = r
        for_receiver("often")
        sender.delivered({"often": True})
    assert 3 <= rounds_kept < 40   # the history covered a few rounds, then version 1 fell out of it


def test_a_changed_broadcast_resets_the_reference_for_everyone():
    sender = DownlinkSender(coding(), seed=1, extra=lambda: extra)
    extra: dict[str, torch.Tensor] = {}
    stream = broadcasts(3)
    for message in stream:
        sender.code(message)
        sender.delivered({"a": True})
    other = Payload(tensors={"w": torch.ones(30, 20), "v": torch.zeros(40)})
    sent = sender.code(other)("a")
    assert BASE_KEY not in sent.scalars and torch.equal(sent.tensors["w"], torch.ones(30, 20))
    assert set(sender.reference()) == {"w", "v"}


def coded_message() -> tuple[DownlinkSender, DownlinkReceiver, Payload]:
    sender = DownlinkSender(coding(), seed=1, extra=lambda: extra)
    extra: dict[str, torch.Tensor] = {}
    receiver = DownlinkReceiver(coding())
    stream = broadcasts(2)
    receiver.receive(wire(sender.code(next(stream))("a")), "a")
    sender.delivered({"a": True})
    return sender, receiver, wire(sender.code(next(stream))("a"))


def bad(message: Payload, **changes) -> Payload:
    tensors = {k: v for k, v in message.tensors.items() if k not in changes.get("drop", ())}
    tensors.update(changes.get("tensors", {}))
    return Payload(tensors=tensors, scalars={**message.scalars, **changes.get("scalars", {})})


@pytest.mark.parametrize("case,code", [
    ("stale base", "STALE_BASE"), ("missing version", "BAD_NAME"), ("unknown tensor", "BAD_NAME"),
    ("short part", "BAD_SHAPE"), ("bad version scalar", "BAD_SCALAR"), ("index out of range", "BAD_SHAPE"),
])
def test_a_bad_coded_message_is_a_typed_error_and_the_reference_stays(case, code):
    _, receiver, message = coded_message()
    before = {n: t.clone() for n, t in receiver.reference.items()}
    val, idx = part_name(2, TopK(), "val", "w"), next(n for n in message.tensors if n.startswith("down2.topk.") and
                                                      n.endswith(":w") and ".val:" not in n)
    variants = {
        "stale base": bad(message, scalars={BASE_KEY: 5, VERSION_KEY: 6}),
        "missing version": bad(message, scalars={VERSION_KEY: 3}),   # version 3 brought by version 2 alone
        "unknown tensor": bad(message, tensors={part_name(2, TopK(), "val", "zz"): torch.zeros(3)}),
        "short part": bad(message, tensors={val: torch.zeros(K - 1)}),
        "bad version scalar": bad(message, scalars={VERSION_KEY: "two"}),
        "index out of range": bad(message, drop=(idx,), tensors={
            part_name(2, TopK(), "idx32", "w"): torch.full((K,), 10_000, dtype=torch.int32)}),
    }
    with pytest.raises(PayloadError) as err:
        receiver.receive(variants[case], "a")
    assert err.value.code == code, err.value
    assert receiver.version == 1 and all(torch.equal(before[n], receiver.reference[n]) for n in before)
    assert receiver.receive(message, "a").tensors["w"].shape == (30, 20)   # the good message still applies


BASE = """
[run]
name = "down"
seed = 5
rounds = 8
eval_every = 4
[algorithm]
name = "fedavg"
lr = 0.05
local_epochs = 1
batch_size = 16
[data]
dataset = "digits"
partition = "dirichlet"
[model]
kind = "mlp"
hidden = [32]
[clients]
count = 10
per_round = 2
processes = 5
[compression]
down = "topk"
down_keys = {k = 40}
"""


def test_coded_broadcasts_over_grpc_equal_the_engine_and_their_bytes(tmp_path):
    """A star run over gRPC, 2 of 10 clients a round on 5 processes, so most processes skip
    rounds: the final model equals the in-process engine's bit for bit (every client trained
    from the reference), and every train message's tensor bytes are the coded differences its
    process missed (by the engine's replay of the same broadcasts) or the plain model."""
    (tmp_path / "exp.toml").write_text(BASE)
    done = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "exp.toml", "--out", "runs/d", "--quiet"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "runs" / "d"
    cfg = parse_config(BASE)
    engine = RoundEngine(cfg)
    sizes: dict[int, int] = {}
    downlink = engine._downlink
    assert downlink is not None
    threads = torch.get_num_threads()   # the run's processes compute with run.torch_threads (server/__main__.py)
    torch.set_num_threads(cfg.run.torch_threads)
    try:
        for r in range(1, cfg.run.rounds + 1):
            engine.train_round(r)
            if downlink.history and downlink.history[-1][0] == r:
                sizes[r] = downlink.history[-1][2]
    finally:
        torch.set_num_threads(threads)
    final = load_file(str(out / "model.safetensors"))
    assert set(final) == set(engine.state.params)
    assert all(torch.equal(final[n], engine.state.params[n].cpu()) for n in final)
    plain = sum(t.numel() * t.element_size() for t in engine.state.params.values())
    process_of = {cid: p.node_id for p in plan_processes(cfg).clients for cid in p.clients}
    with sqlite3.connect(out / "run.db") as db:
        rows = db.execute("SELECT round, dst, tensor_bytes FROM messages WHERE method = 'train' AND role = 'sender' "
                          "ORDER BY round, dst").fetchall()
        assert db.execute("SELECT COUNT(*) FROM events WHERE kind LIKE '%fail%'").fetchone()[0] == 0
    held: dict[str, int] = {}
    kinds: set[str] = set()
    counted = {"coded_messages": 0, "plain_messages": 0}
    for r in range(1, cfg.run.rounds + 1):
        this_round = [(dst, b) for rr, dst, b in rows if rr == r]
        assert len(this_round) == 2
        kept = kept_versions(sizes, r, plain)
        for dst, tensor_bytes in this_round:
            proc = process_of[int(dst.split("-")[1])]
            base = held.get(proc)
            if base is not None and base + 1 in kept:
                assert tensor_bytes == sum(sizes[v] for v in range(base + 1, r + 1)), (r, dst)
                kinds.add("next" if base == r - 1 else "catch-up")
                counted["coded_messages"] += 1
            else:
                assert tensor_bytes == plain, (r, dst)
                kinds.add("plain")
                counted["plain_messages"] += 1
        for dst, _ in this_round:
            held[process_of[int(dst.split("-")[1])]] = r
    assert {"plain", "catch-up"} <= kinds, kinds   # processes that skipped rounds: caught up, or resynced
    summary = json.loads((out / "summary.json").read_text())
    assert summary["downlink"] == {**counted, "reference_version": cfg.run.rounds}


def kept_versions(sizes: dict[int, int], r: int, plain: int) -> list[int]:
    """The versions whose differences the server still keeps after round r: the latest ones
    while their bytes together stay below the plain model's."""
    kept: list[int] = []
    total = 0
    for v in range(r, 1, -1):
        if v not in sizes or total + sizes[v] >= plain:
            break
        kept.insert(0, v)
        total += sizes[v]
    return kept


@pytest.mark.parametrize("setting,needle", [
    ('down = "tpok"', "did you mean 'topk'"),
    ('down = "topk"\ndown_keys = {ratoi = 0.1}', "compression.down_keys.ratoi"),
    ('down = "same"', "'same' needs compression.up"),
])
def test_a_bad_downlink_key_is_one_line_and_exit_2(tmp_path, setting, needle):
    text = BASE.split("[compression]")[0] + "[compression]\n" + setting + "\n"
    (tmp_path / "bad.toml").write_text(text)
    done = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "bad.toml", "--out", "runs/b"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], done.stderr
    assert not (tmp_path / "runs").exists()


def test_coded_broadcasts_need_a_topology_and_transport_that_send_train_calls():
    with pytest.raises(ConfigError, match="compression.down.*topology.kind = 'chain' does not send"):
        parse_config(BASE + '[topology]\nkind = "chain"\n')
    with pytest.raises(ConfigError, match="compression.down.*transport.kind = 'torch' broadcasts by its own"):
        parse_config(BASE + '[transport]\nkind = "torch"\n')
    assert parse_config(BASE + '[transport]\nkind = "inmemory"\n').compression.down_params is not None


def test_a_resumed_run_continues_from_the_saved_reference_bit_for_bit(tmp_path):
    """The reference (and PowerSGD's warm-start memory of the broadcasts) is part of the server
    state a checkpoint keeps: a run resumed from round 4 of 6 ends with the uninterrupted run's
    model bit for bit (after a resume every process gets the reference plain, once)."""
    text = BASE.replace("rounds = 8", "rounds = 6").replace('down = "topk"\ndown_keys = {k = 40}',
                                                          'down = "powersgd"\ndown_keys = {rank = 2}')
    (tmp_path / "exp.toml").write_text(text)
    run_dir = tmp_path / "run"
    assert run_local(str(tmp_path / "exp.toml"), ["run.checkpoint_every=2"], str(run_dir), quiet=True,
                     show_table=False) == 0
    uninterrupted = load_file(str(run_dir / "model.safetensors"))
    checkpoints = list_checkpoints(run_dir)
    assert [p.name for p in checkpoints] == ["round-000004.safetensors", "round-000006.safetensors"]
    saved = load_checkpoint(checkpoints[0])
    assert int(saved.extra["down_ref_version"]) == 4
    assert any(k.startswith("down_ref:") for k in saved.extra) and any("powersgd_memory" in k for k in saved.extra)
    checkpoints[-1].unlink()
    assert resume_local(str(run_dir), quiet=True, show_table=False) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["faults"]["resumes"][0]["from_round"] == 4
    resumed = load_file(str(run_dir / "model.safetensors"))
    assert all(torch.equal(resumed[n], uninterrupted[n]) for n in uninterrupted)


HIER = BASE.replace("count = 10\nper_round = 2\nprocesses = 5", "count = 12\nper_round = 4\nprocesses = 6").replace(
    "rounds = 8", "rounds = 6") + '[topology]\nkind = "hierarchical"\nedges = 2\nkappa2 = 2\n'


@pytest.mark.parametrize("topology", ["star", "hierarchical"])
def test_the_model_does_not_depend_on_which_messages_were_coded(tmp_path, topology):
    """The same run with the clients on few processes and on one process each: the processes
    skip different rounds, so other messages are coded differences and others resyncs (on every
    link: the server's to edges or processes, each edge's to its processes), yet every client
    trains from the same reference, so the final models are equal bit for bit."""
    text = BASE if topology == "star" else HIER
    (tmp_path / "exp.toml").write_text(text)
    count = parse_config(text).clients.count
    runs = {}
    for processes in (2, count):
        done = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "exp.toml", "--out", f"runs/p{processes}",
                               "--quiet", "--set", f"clients.processes={processes}"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[processes] = tmp_path / "runs" / f"p{processes}"
    models = {p: load_file(str(out / "model.safetensors")) for p, out in runs.items()}
    assert all(torch.equal(models[2][n], models[count][n]) for n in models[2])
    plain = sum(t.numel() * t.element_size() for t in models[2].values())
    shapes = {}
    for p, out in runs.items():
        with sqlite3.connect(out / "run.db") as db:
            rows = db.execute("SELECT link, tensor_bytes FROM messages WHERE role = 'sender' AND method IN "
                              "('train', 'edge_round')").fetchall()
        assert all(b <= plain for _, b in rows)
        shapes[p] = sorted((link, b == plain) for link, b in rows)
        links = {link for link, _ in rows}
        for link in links:   # each link carried coded differences
            assert any(b < plain for ln, b in rows if ln == link), (p, link)
    assert shapes[2] != shapes[count]   # other messages were coded


@pytest.mark.parametrize("feedback", ["ef", "ef21"])
def test_a_resumed_hierarchical_run_restores_the_edges_own_state_bit_for_bit(tmp_path, feedback):
    """Each edge's error-feedback state (EF-SGD's residuals, or EF21's estimate of its partial and
    its copies of its clients' estimates) and its own broadcast reference are in the checkpoint
    (`node/EDGE/...`): a run resumed from round 4 of 6 ends with the uninterrupted run's model
    bit for bit."""
    text = HIER.replace('down = "topk"\ndown_keys = {k = 40}',
                        f'up = "topk"\nk = 30\nerror_feedback = "{feedback}"\nedge = "same"\ndown = "topk"\n'
                        f'down_keys = {{k = 40}}')
    (tmp_path / "exp.toml").write_text(text)
    run_dir = tmp_path / "run"
    assert run_local(str(tmp_path / "exp.toml"), ["run.checkpoint_every=2"], str(run_dir), quiet=True,
                     show_table=False) == 0
    uninterrupted = load_file(str(run_dir / "model.safetensors"))
    checkpoints = list_checkpoints(run_dir)
    saved = load_checkpoint(checkpoints[0])
    assert saved.round == 4 and sorted(saved.node_states) == ["edge-0", "edge-1"]
    for state in saved.node_states.values():
        kept = ("upload/ef_residual:",) if feedback == "ef" else ("upload/ef21_g:", "upload/ef21:client-")
        assert all(any(k.startswith(prefix) for k in state) for prefix in kept), sorted(state)[:8]
        assert int(state["downlink/down_ref_version"]) == 4 * 2   # two edge iterations (kappa2) a round
    checkpoints[-1].unlink()
    assert resume_local(str(run_dir), quiet=True, show_table=False) == 0
    resumed = load_file(str(run_dir / "model.safetensors"))
    assert all(torch.equal(resumed[n], uninterrupted[n]) for n in uninterrupted)


def test_two_compressed_runs_at_once_match_the_same_runs_alone(tmp_path):
    """Two runs started together from one folder (coded uploads with error feedback; coded
    broadcasts with PowerSGD) each end with the model and the per-message bytes of the same
    run made alone: nothing of one run's coding state reaches the other."""
    (tmp_path / "exp.toml").write_text(BASE.replace("rounds = 8", "rounds = 4"))
    settings = {"up": ["--set", 'compression.down="none"', "--set", "compression.down_keys={}",
                       "--set", 'compression.up="topk"', "--set", "compression.k=30",
                       "--set", 'compression.error_feedback="ef"'],
                "down": ["--set", 'compression.down="powersgd"', "--set", "compression.down_keys={rank = 2}"]}

    def start(name: str, out: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "exp.toml", "--out", out,
                                 "--quiet", *settings[name]], cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    together = {name: start(name, f"runs/{name}-together") for name in settings}
    for name, proc in together.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (name, err[-3000:])
    for name in settings:
        alone = start(name, f"runs/{name}-alone")
        _, err = alone.communicate(timeout=600)
        assert alone.returncode == 0, (name, err[-3000:])

    def traffic(out: str) -> list[tuple]:
        with sqlite3.connect(tmp_path / "runs" / out / "run.db") as db:
            return db.execute("SELECT round, method, dst, tensor_bytes FROM messages WHERE role = 'sender' AND "
                              "method IN ('train', 'train.reply') ORDER BY round, method, dst").fetchall()

    for name in settings:
        a, b = (load_file(str(tmp_path / "runs" / f"{name}-{w}" / "model.safetensors")) for w in ("together", "alone"))
        assert all(torch.equal(a[n], b[n]) for n in a), name
        assert traffic(f"{name}-together") == traffic(f"{name}-alone"), name
    plain = traffic("down-alone")[0][3]
    assert any(b < plain for _, m, _, b in traffic("down-alone") if m == "train")   # broadcasts were coded
    assert any(b < plain for _, m, _, b in traffic("up-alone") if m == "train.reply")   # uploads were coded
