"""The processor chain (issue 27, item 3; common/processors/pipeline.py): one chain per method and direction,
which every role asks for, and a user's processor installed in it sees every reply, over real
processes on the star, hierarchical (at the edges and at the server) and torch.distributed paths.

The user's processor is installed by the module of an algorithm plug-in (the documented recipe,
docs/architecture.md "Add a processor"): every process that parses the config imports it.  It
appends one line per message it sees to the file CHAINPROBE_LOG names, and refuses client 1's
reply in round 2 where CHAINPROBE_REFUSE is set.
"""
from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from fedhop.common.processors import pipeline
from fedhop.common.processors.compress import compress_upload
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import Payload
from fedhop.deploy.launch.launcher import run_local
from tests.helpers import db_rows, quadratic_config

ROOT = Path(__file__).resolve().parents[1]
RNG = np.random.default_rng(27)
CENTERS = RNG.normal(0, 2, size=(6, 4))
CURV = RNG.uniform(0.5, 2.0, size=(6, 4))
SIZES = [5, 9, 13, 3, 7, 11]
ROUNDS = 2

PROBE = '''
import os

from fedhop.common.algorithms.fedavg import FedAvg
from fedhop.common.wire.codec import PayloadError
from fedhop.common.processors.pipeline import install


class Probe:
    def process(self, message, ctx):
        weight = float(message.scalars.get("weight", -1.0))
        with open(os.environ["CHAINPROBE_LOG"], "a") as fh:
            fh.write(f"{os.getpid()}|{ctx.method}|{ctx.direction}|{ctx.round}|{ctx.peer or '-'}|{weight!r}|{ctx.who}\\n")
        if (os.environ.get("CHAINPROBE_REFUSE") and ctx.method == "train" and ctx.peer == "client-1"
                and ctx.round == 2):
            raise PayloadError("PROBE_REFUSED", f"{ctx.who}: refused by the probe")
        return message


class ProbeAvg(FedAvg):
    name = "probe_avg"


REMOVE = install(Probe(), direction="in")
'''


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """The probe package beside the config; the log file; this process's copy uninstalled after."""
    (tmp_path / "chainprobe").mkdir()
    (tmp_path / "chainprobe" / "__init__.py").write_text(PROBE)
    log = tmp_path / "probe.log"
    monkeypatch.setenv("CHAINPROBE_LOG", str(log))
    monkeypatch.setenv("FEDHOP_PLUGIN_PATH", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield log
    module = sys.modules.pop("chainprobe", None)
    if module is not None:
        module.REMOVE()


def _run(tmp_path: Path, name: str, topology: str = "", transport: str = "grpc", processes: int = 1) -> Path:
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=ROUNDS, processes=processes, topology=topology,
                            algorithm="chainprobe:ProbeAvg", local_steps=2, name=name)
    (tmp_path / f"{name}.toml").write_text(text.replace('kind = "grpc"', f'kind = "{transport}"'))
    assert run_local(f"{name}.toml", [], name, quiet=True, show_table=False) == 0   # relative paths, from tmp_path
    return tmp_path / name


def _lines(log: Path) -> list[dict]:
    out = []
    for line in log.read_text().splitlines():
        pid, method, direction, rnd, peer, weight, who = line.split("|", 6)
        out.append({"pid": int(pid), "method": method, "direction": direction, "round": int(rnd), "peer": peer,
                    "weight": float(weight), "who": who})
    return out


# ----------------------------------------------------------------------------- the roles ask one place
def test_roles_build_no_pipeline_by_hand():
    """No role constructs a pipeline stage or validates a reply itself: they ask common/processors/pipeline.py."""
    pattern = re.compile(r"\b(ReplyPipeline|ModelPipeline|validate_reply|decompress_upload|compress_upload)\(")
    found = [f"{p.relative_to(ROOT)}:{i}" for d in ("server", "edge", "client") for p in sorted((ROOT / d).rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


# ----------------------------------------------------------------------------- the chain in process
class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int, str]] = []

    def process(self, message: Payload, ctx: pipeline.Context) -> Payload:
        self.seen.append((ctx.method, ctx.direction, ctx.round, ctx.peer))
        return message


class _Cfg:   # the config fields the chain reads
    class algorithm:
        compress, qsgd_levels, qsgd_bucket = "qsgd", 4, 0

    class run:
        seed = 3


def test_a_user_processor_sees_the_decoded_validated_reply_of_its_methods_only():
    spec = {"w": (torch.float32, (5,))}
    w = torch.linspace(-1.0, 1.0, 5)
    coded = compress_upload(_Cfg, Payload(tensors={"w": w}, scalars={"weight": 2.0}), "client-4", 7, 0)
    assert set(coded.tensors) != {"w"}   # on the wire: QSGD codes and norms, not w
    seen_values: list[torch.Tensor] = []

    class Values:
        def process(self, message, ctx):
            seen_values.append(message.tensors["w"])
            return message

    rec = Recorder()
    removers = [pipeline.install(rec, methods=["train"]), pipeline.install(Values(), methods=["train"])]
    try:
        out = pipeline.reply_chain(_Cfg, spec, "train", round=7, peer="client-4")(coded, "round 7 reply of client 4")
        pipeline.reply_chain(_Cfg, spec, "edge_round", round=7)(coded, "round 7 partial of edge-0")
        with pytest.raises(PayloadError, match="BAD_SHAPE"):   # the built-in validation comes first: not seen
            pipeline.reply_chain(_Cfg, spec, "train", round=8)(Payload(tensors={"w": torch.zeros(4)},
                                                                      scalars={"weight": 1.0}), "a reply")
    finally:
        for remove in removers:
            remove()
    assert rec.seen == [("train", "in", 7, "client-4")]
    assert torch.equal(seen_values[0], out.tensors["w"]) and tuple(out.tensors["w"].shape) == (5,)
    # QSGD's decoding of w (levels 4): every value a multiple of ||w|| / 4 with w's sign
    norm = float(torch.linalg.vector_norm(w))
    assert torch.allclose(out.tensors["w"] * 4 / norm, torch.round(out.tensors["w"] * 4 / norm), atol=1e-5)
    assert pipeline.installed("train", "in") == []


def test_a_refusal_is_a_payload_error_and_out_processors_run_before_compression():
    class Refuse:
        def process(self, message, ctx):
            raise PayloadError("PROBE_REFUSED", f"{ctx.who} refused")

    class Double:
        def process(self, message, ctx):
            return Payload(tensors={k: v * 2 for k, v in message.tensors.items()}, scalars=message.scalars)

    spec = {"w": (torch.float32, (3,))}
    reply = Payload(tensors={"w": torch.ones(3)}, scalars={"weight": 1.0})
    removers = [pipeline.install(Refuse(), methods=["train"]), pipeline.install(Double(), direction="out")]
    try:
        with pytest.raises(PayloadError, match="^PROBE_REFUSED: round 1 reply of client 2 refused$"):
            pipeline.reply_chain(_Cfg, spec, "train", round=1)(reply, "round 1 reply of client 2")
        model = pipeline.model_chain(spec, "walk_handoff")(reply, "hand-off from client-1")   # another method
        sent = pipeline.upload(_Cfg, reply, "client-2", 1, 0)
    finally:
        for remove in removers:
            remove()
    assert torch.equal(model["w"], torch.ones(3))
    # doubled, then coded from the same QSGD stream ("qsgd", sender, round, step)
    expected = compress_upload(_Cfg, Payload(tensors={"w": torch.full((3,), 2.0)}, scalars={"weight": 1.0}),
                               "client-2", 1, 0)
    assert sent.tensors.keys() == expected.tensors.keys() != {"w"}
    assert all(torch.equal(sent.tensors[k], expected.tensors[k]) for k in expected.tensors)
    with pytest.raises(ValueError, match="direction"):
        pipeline.install(Refuse(), direction="both")  # type: ignore[arg-type]


def _chain_as_made_before(cfg, spec, method, scalars, limits, round, peer, memory, folded):
    """The chain `reply_chain` made for one peer before `ReplyChains`: every part built for it, the
    bound found by asking each processor in turn (no `known_bound`)."""
    users = pipeline.installed(method, "in")
    return pipeline.ProcessorChain([pipeline.Decompress(cfg, spec, memory, sparse=folded and not users),
                                    pipeline.ValidateReply(spec, scalars, limits), *users], method, "in", round, peer)


@pytest.mark.parametrize("compression", ["", 'up = "topk"\nratio = 0.25'])
def test_a_rounds_reply_chains_are_the_chains_made_one_by_one(compression):
    """`ReplyChains.chain(peer, limits)` (a round's chains, the parts that do not depend on the peer
    made once) gives each peer the chain made for it alone: the same processors in the same order
    with the same fields, the same bound (with and without an upload coding, whose bound is larger
    than the plain reply's), and the same outcome on a reply and on a refused one."""
    from fedhop.common.config import parse_config
    from fedhop.common.processors.validation import ReplyLimits
    from tests.helpers import quadratic_config

    text = quadratic_config(CENTERS, CURV, SIZES, rounds=1)
    cfg = parse_config(text + (f"\n[compression]\n{compression}\n" if compression else ""))
    spec = {"w": (torch.float32, (4,)), "b": (torch.float32, (2, 3))}
    scalars = {"weight": pipeline.REPLY_SCALARS["weight"]}   # the chains' own scalar rules, passed through
    rec = Recorder()
    remove = pipeline.install(rec, methods=["train"])
    try:
        chains = pipeline.ReplyChains(cfg, spec, "train", scalars, round=5, memory={}, folded=True)
        for cid, weight in ((3, 2.0), (8, None), (11, 7.5)):
            limits = ReplyLimits(weight=weight, results=1, seconds=9.0)
            made = chains.chain(f"client-{cid}", limits)
            before = _chain_as_made_before(cfg, spec, "train", scalars, limits, 5, f"client-{cid}", {}, True)
            assert [type(p) for p in made.processors] == [type(p) for p in before.processors]
            assert made.processors[1:] == before.processors[1:]   # ValidateReply (by value), the user's
            assert made.processors[0] == before.processors[0]     # Decompress: equal fields, one object a round
            assert made.processors[0] is chains.chain("client-0").processors[0]
            assert (made.method, made.direction, made.round, made.peer) == ("train", "in", 5, f"client-{cid}")
            assert made.bound == before.bound and made.bound is not None
            reply = Payload(tensors={"w": torch.arange(4.0), "b": torch.ones(2, 3)}, scalars={"weight": 1.0})
            if compression:
                assert made.bound.data_bytes > pipeline.reply_bound(spec).data_bytes   # the coding's margin
                continue
            out = made(reply, f"round 5 reply of client {cid}")
            assert torch.equal(out.tensors["w"], before(reply, "r").tensors["w"])
            with pytest.raises(PayloadError, match="BAD_SHAPE"):
                made(Payload(tensors={"w": torch.zeros(3), "b": torch.ones(2, 3)}, scalars={"weight": 1.0}), "r")
    finally:
        remove()
    if not compression:
        assert rec.seen.count(("train", "in", 5, "client-3")) == 2 and ("train", "in", 5, "client-11") in rec.seen
    assert pipeline.reply_chain(cfg, spec, "train", round=2, peer="client-1").bound == \
        _chain_as_made_before(cfg, spec, "train", None, None, 2, "client-1", None, False).bound


# ----------------------------------------------------------------------------- over real processes
def test_user_processor_sees_every_reply_on_star_and_refuses_one(tmp_path, probe, monkeypatch):
    monkeypatch.setenv("CHAINPROBE_REFUSE", "1")
    run_dir = _run(tmp_path, "star")
    lines = [x for x in _lines(probe) if x["method"] == "train"]
    assert len({x["pid"] for x in lines}) == 1   # the server's chain
    assert Counter(x["round"] for x in lines) == {r: len(SIZES) for r in range(1, ROUNDS + 1)}
    for x in lines:   # each reply as the server uses it: the client's weight is its data size
        cid = int(x["peer"].split("-")[1])
        assert x["weight"] == SIZES[cid] and x["who"] == f"round {x['round']} reply of client {cid}"
    events = db_rows(run_dir / "run.db", "SELECT round, node, detail FROM events WHERE detail LIKE '%PROBE_REFUSED%'")
    assert [(r, n) for r, n, _ in events] == [(2, "client-1")]
    participants = dict(db_rows(run_dir / "run.db", "SELECT round, participants FROM rounds"))
    assert participants == {1: len(SIZES), 2: len(SIZES) - 1}


def test_user_processor_sees_every_reply_at_the_edges_and_the_server(tmp_path, probe):
    kappa2 = 2
    _run(tmp_path, "hier", topology=f'kind = "hierarchical"\nedges = 2\nkappa2 = {kappa2}', processes=2)
    lines = _lines(probe)
    replies = [x for x in lines if x["method"] == "train"]
    partials = [x for x in lines if x["method"] == "edge_round"]
    # every client's reply at its edge, kappa2 edge iterations a round; one partial per edge at the server
    assert Counter((x["round"], x["peer"]) for x in replies) == {(r, f"client-{c}"): kappa2 for r in range(1, ROUNDS + 1)
                                                                for c in range(len(SIZES))}
    assert len({x["pid"] for x in replies}) == 2 and not {x["pid"] for x in replies} & {x["pid"] for x in partials}
    assert Counter((x["round"], x["peer"]) for x in partials) == {(r, f"edge-{e}"): 1 for r in range(1, ROUNDS + 1)
                                                                 for e in range(2)}
    for r in range(1, ROUNDS + 1):   # the edges speak for all their clients: the weights add up to the data
        assert sum(x["weight"] for x in partials if x["round"] == r) == sum(SIZES)


def test_user_processor_sees_the_reduced_partial_on_the_torch_path(tmp_path, probe):
    _run(tmp_path, "torch", transport="torch")
    lines = [x for x in _lines(probe) if x["direction"] == "in"]
    assert [(x["method"], x["round"]) for x in lines] == [("torch_reduce", r) for r in range(1, ROUNDS + 1)]
    assert all(x["weight"] == sum(SIZES) for x in lines)   # one partial of every client process's clients
    assert all(x["who"] == f"round {x['round']} reduced partial of the client processes" for x in lines)


def test_one_clients_reply_limits_are_shared_by_clients_of_one_weight_bound():
    """`ReplyLimiter.limits([cid])` (asked for every sampled client of a star round) equals the
    limits worked out for that client alone, and is one object for all clients of the same weight
    bound: at 1,000,000 clients the server keeps a few, not one a client it ever sampled."""
    from fedhop.common.processors.validation import ReplyLimiter, ReplyLimits

    sizes = [5, 9, 5, 13, 9, 5, 0]

    class Task:
        def num_samples(self, cid: int) -> int:
            return sizes[cid]

    class Algorithm:
        def max_weight(self, samples: int) -> float | None:
            return None if samples == 0 else float(samples) * 1.5

    limiter = ReplyLimiter(Algorithm(), Task(), 12.0)
    got = [limiter.limits([cid]) for cid in range(len(sizes))]
    assert got == [ReplyLimits(weight=None if n == 0 else n * 1.5, results=1, seconds=12.0) for n in sizes]
    assert len({id(x) for x in got}) == len(set(sizes)) == 4
    assert got[0] is got[2] is got[5] and got[1] is got[4] and got[6].weight is None
    assert limiter.limits([0, 1, 6]) == ReplyLimits(weight=None, results=3, seconds=12.0)
    assert limiter.limits([0, 3]) == ReplyLimits(weight=27.0, results=2, seconds=12.0)
