"""A user's processors named in the config (issue 27, item 3; common/processors/pipeline.py): `[[processors]]`
tables, each a plug-in reference, its methods, direction, roles and keyword options, validated
when the config loads (one line naming the key, exit 2), installed by each role process in the
chains it asks for, and loaded by a client only when it was started with it (issue 26, item 5).

The processors live in a module beside the config in the user's folder (tmp_path): `Count`
appends one line per message it sees to a file named by its option, `Refuse` refuses the
messages of one peer in one round.
"""
from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from fedhop.common.config import ConfigError, parent_config, parse_config
from fedhop.common.processors import pipeline
from fedhop.common.records.runstore import RunStore
from fedhop.common.util import plugins
from fedhop.deploy.cli.cli import main as fedhop
from fedhop.deploy.launch.inmemory import run_inmemory
from fedhop.deploy.launch.launcher import run_local
from tests.helpers import db_rows, quadratic_config

RNG = np.random.default_rng(2027)
N, D = 5, 3
CENTERS = RNG.normal(0, 2, size=(N, D))
CURV = RNG.uniform(0.5, 2.0, size=(N, D))
SIZES = [6, 3, 8, 2, 5]
ROUNDS = 3
EDGES = [[0, 1], [1, 2], [2, 3], [3, 4], [0, 2], [1, 4]]   # a gossip graph, not regular

PROCS = '''
import os

from fedhop.common.wire.codec import PayloadError

MARK = os.environ.get("USERPROCS_MARK")
if MARK:
    open(MARK, "w").write("imported")


class Count:
    def __init__(self, path):
        self.path = path

    def process(self, message, ctx):
        with open(self.path, "a") as fh:
            fh.write(f"{os.getpid()}|{ctx.method}|{ctx.direction}|{ctx.round}|{ctx.peer or '-'}|{ctx.who}\\n")
        return message


class Refuse:
    def __init__(self, peer, round, code="USER_REFUSED"):
        self.peer, self.round, self.code = peer, round, code

    def process(self, message, ctx):
        if ctx.round == self.round and (ctx.peer == self.peer or self.peer in ctx.who):
            raise PayloadError(self.code, f"{ctx.who}: refused by the user's processor")
        return message
'''


def entry(name: str, methods: list[str], roles: list[str], direction: str = "in", **options) -> str:
    opts = "".join(f"{k} = {json.dumps(v)}\n" for k, v in options.items())
    return (f'\n[[processors]]\nname = "{name}"\nmethods = {json.dumps(methods)}\ndirection = "{direction}"\n'
            f"roles = {json.dumps(roles)}\n{opts}")


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """The user's folder: the processors' module beside the config; this process's chains and the
    module forgotten after."""
    (tmp_path / "userprocs.py").write_text(PROCS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(plugins.PLUGIN_PATH_ENV, str(tmp_path))
    monkeypatch.delenv(plugins.ALLOW_ENV, raising=False)
    monkeypatch.delenv("USERPROCS_MARK", raising=False)
    yield tmp_path
    pipeline.unconfigure()
    plugins.unrestricted()
    sys.modules.pop("userprocs", None)


def _lines(path: Path) -> list[dict]:
    keys = ("pid", "method", "direction", "round", "peer", "who")
    rows = [dict(zip(keys, line.split("|", 5))) for line in path.read_text().splitlines()] if path.exists() else []
    return [{**r, "round": int(r["round"]), "pid": int(r["pid"])} for r in rows]


# ----------------------------------------------------------------------------- the config
BASE = quadratic_config(CENTERS, CURV, SIZES, rounds=ROUNDS, processes=2, local_steps=2, name="procs")


@pytest.mark.parametrize("table, key, why", [
    (entry("userprocs:Count", ["trian"], ["server"], path="c"), "processors[0].methods[0]", "'trian', allowed: train"),
    (entry("userprocs:Count", ["train"], ["server"], direction="both", path="c"), "processors[0].direction",
     "'both', allowed: in, out"),
    (entry("userprocs:Count", ["train"], ["server", "worker"], path="c"), "processors[0].roles[1]",
     "'worker', allowed: server, edge, client"),
    (entry("userprocs:Count", ["train"], [], path="c"), "processors[0].roles", "no process runs"),
    (entry("nosuchpkg:Count", ["train"], ["server"]), "processors[0].name", "No module named 'nosuchpkg'"),
    (entry("userprocs:Cuont", ["train"], ["server"]), "processors[0].name", "has no attribute 'Cuont'"),
    (entry("userprocs:Count", ["train"], ["server"], pth="c"), "processors[0].pth", "takes no option 'pth' (its "
     "options: path)"),
    (entry("userprocs:Count", ["train"], ["server"]), "processors[0]", "missing a required argument: 'path'"),
    (entry("userprocs:PROCS", ["train"], ["server"]), "processors[0].name", "without a process(message, ctx)"),
    ('\n[[processors]]\nmethods = ["train"]\n', "processors[0].name", "is required"),
    ('\n[processors]\nname = "userprocs:Count"\n', "processors", "must be an array of tables"),
])
def test_a_bad_processor_entry_is_one_line_naming_its_key(folder, table, key, why):
    (folder / "userprocs.py").write_text(PROCS + '\nPROCS = "not a processor"\n')
    with pytest.raises(ConfigError) as exc:
        parse_config(BASE + table)
    assert f"config key '{key}" in str(exc.value) and why in str(exc.value) and "\n" not in str(exc.value)


def test_fedhop_run_refuses_a_bad_entry_with_exit_2_and_starts_nothing(folder, capsys):
    (folder / "exp.toml").write_text(BASE + entry("userprocs:Count", ["train", "walk_hand_off"], ["server"], path="c"))
    assert fedhop(["run", "exp.toml", "--out", "runs/bad"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "processors[0].methods[1]" in err and "walk_hand_off" in err, err
    assert not (folder / "runs").exists()


def test_entries_round_trip_and_are_the_children_allow_list(folder):
    cfg = parse_config(BASE + entry("userprocs:Count", ["train"], ["server"], path="c.txt")
                       + entry("userprocs:Refuse", [], ["client"], direction="out", peer="client-1", round=2))
    assert [(p.name, p.methods, p.direction, p.roles, p.options) for p in cfg.processors] == [
        ("userprocs:Count", ["train"], "in", ["server"], {"path": "c.txt"}),
        ("userprocs:Refuse", [], "out", ["client"], {"peer": "client-1", "round": 2})]
    from fedhop.common.config import config_to_toml
    assert parse_config(config_to_toml(cfg)) == cfg
    assert plugins.config_plugins(cfg) == ["userprocs"]


def test_configure_installs_a_roles_entries_only_and_a_new_config_replaces_them(folder):
    cfg = parse_config(BASE + entry("userprocs:Count", ["train"], ["server"], path="s.txt")
                       + entry("userprocs:Count", [], ["client"], direction="out", path="c.txt"))
    pipeline.configure(cfg, "client")
    assert pipeline.installed("train", "in") == []
    assert [p.path for p in pipeline.installed("gossip_share", "out")] == ["c.txt"]   # methods = []: every one
    pipeline.configure(cfg, "server")   # the same config in the same process (in-memory runs): both roles
    assert [p.path for p in pipeline.installed("train", "in")] == ["s.txt"]
    assert pipeline.installed("edge_round", "in") == []
    pipeline.configure(parse_config(BASE), "server")   # another run's config: none of the old ones
    assert pipeline.installed("train", "in") == pipeline.installed("gossip_share", "out") == []


# ----------------------------------------------------------------------------- a client runs only its own code
def test_a_parent_config_naming_a_processor_off_the_allow_list_is_refused_never_imported(folder, monkeypatch):
    mark = folder / "mark"
    monkeypatch.setenv("USERPROCS_MARK", str(mark))
    text = BASE + entry("userprocs:Count", ["train"], ["server"], path="c")   # a server-only one, still refused
    plugins.restrict(["mymodels"])
    with pytest.raises(RuntimeError, match=r"^client-proc0: refusing the run's config from server: config key "
                                           r"'processors\[0\].name': PLUGIN_NOT_ALLOWED.*'userprocs:Count'"):
        parent_config(text, "client-proc0", "server", role="client")
    assert not mark.exists() and "userprocs" not in sys.modules and pipeline.installed("train", "in") == []
    plugins.restrict(["userprocs"])
    cfg = parent_config(text, "client-proc0", "server", role="client")
    assert mark.exists() and cfg.processors[0].name == "userprocs:Count"


def test_a_parent_config_nested_too_deeply_is_refused_naming_the_config():
    text = BASE + "x = " + "[" * 100_000 + "]" * 100_000 + "\n"
    with pytest.raises(RuntimeError, match=r"^client-proc0: refusing the run's config from edge-0: its TOML is "
                                           r"nested too deeply to parse$"):
        parent_config(text, "client-proc0", "edge-0", role="client")


def test_a_client_process_refuses_at_registration_and_imports_nothing(folder):
    """A real client process, started without the processor's module on its allow-list, told of
    a config naming it by its parent: it registers, refuses the config (typed, one line), exits 2."""
    from tests.test_plugin_allowlist import FakeParent, _start
    (folder / "plugins").mkdir()
    (folder / "plugins" / "userprocs.py").write_text(PROCS)
    mark = folder / "mark"
    config = f'[clients]\ncount = 4\n{entry("userprocs:Count", ["train"], ["client"], path="c")}'
    parent = FakeParent(config)
    try:
        proc = _start("client", parent.address, mark, folder, ["--allow-plugin", "mymodels"])
        out, _ = proc.communicate(timeout=180)
    finally:
        parent.endpoint.stop(grace=0.1)
    assert proc.returncode == 2, out
    refusal = [line for line in out.splitlines() if "PLUGIN_NOT_ALLOWED" in line]
    assert len(refusal) == 1 and "processors[0].name" in refusal[0] and "userprocs:Count" in refusal[0], out
    assert parent.registered and not mark.exists() and "Traceback" not in out


# ----------------------------------------------------------------------------- every inbound path
def test_a_config_processor_counts_and_refuses_star_replies_over_real_processes(folder):
    """`fedhop run` from the user's folder, 2 client processes over gRPC: the counting processor at
    the server sees every reply (rounds x clients), the refusing one after it refuses client 1's
    reply in round 2, which the run records and leaves out of that round."""
    text = (BASE + entry("userprocs:Count", ["train"], ["server"], path="counts.txt")
            + entry("userprocs:Refuse", ["train"], ["server"], peer="client-1", round=2))
    (folder / "exp.toml").write_text(text)
    assert run_local("exp.toml", [], "runs/star", quiet=True, show_table=False) == 0
    lines = _lines(folder / "counts.txt")
    assert len({x["pid"] for x in lines}) == 1 and {x["method"] for x in lines} == {"train"}   # the server's chain
    assert Counter((x["round"], x["peer"]) for x in lines) == {(r, f"client-{c}"): 1 for r in range(1, ROUNDS + 1)
                                                              for c in range(N)}
    db = folder / "runs" / "star" / "run.db"
    events = db_rows(db, "SELECT round, node FROM events WHERE detail LIKE '%USER_REFUSED%'")
    assert events == [(2, "client-1")]
    assert dict(db_rows(db, "SELECT round, participants FROM rounds")) == {r: N - (r == 2) for r in range(1, ROUNDS + 1)}


def _gossip(folder: Path, name: str, processors: str) -> dict:
    topology = f'kind = "gossip"\ngossip_edges = {json.dumps(EDGES)}'
    cfg = parse_config(quadratic_config(CENTERS, CURV, SIZES, rounds=ROUNDS, local_steps=2, processes=2,
                                        topology=topology, name="g") + processors)
    summary, _ = run_inmemory(cfg, folder / name)
    return summary


def test_a_config_processor_sees_and_can_refuse_every_gossip_share(folder):
    """Peer receives: each client's share of its model with each graph neighbour, both ways, every
    round, passes the client's gossip_share chain (common/processors/pipeline.py model_chain); a refused
    share fails the round with the processor's reason."""
    summary = _gossip(folder, "counted", entry("userprocs:Count", ["gossip_share"], ["client"], path="shares.txt"))
    assert summary["status"] == "completed", summary["error"]
    lines = _lines(folder / "shares.txt")
    assert len(lines) == ROUNDS * 2 * len(EDGES)   # every edge both ways, every round
    degree = Counter(i for edge in EDGES for i in edge)
    senders = Counter((x["round"], int(x["who"].split(" model of client ")[1].split(" ")[0])) for x in lines)
    assert senders == {(r, i): degree[i] for r in range(1, ROUNDS + 1) for i in range(N)}
    assert {x["peer"] for x in lines} == {"client-proc0", "client-proc1"}   # the sending process
    pipeline.unconfigure()
    summary = _gossip(folder, "refused", entry("userprocs:Refuse", ["gossip_share"], ["client"], peer="model of client 3 ",
                                    round=2, code="SHARE_SCREENED"))
    assert summary["status"] == "failed" and "SHARE_SCREENED" in summary["error"], summary["error"]
    assert summary["rounds_completed"] == 1
    assert RunStore(folder / "refused" / "run.db").rounds()[-1]["round"] == 1


@pytest.mark.slow   # the torch plane takes ~20 s; tests/test_processor_chain.py covers its chain on every run
def test_a_config_processor_sees_the_torch_groups_reduced_partial(folder):
    """The torch.distributed plane: the server's torch_reduce chain sees one reduced partial a round."""
    text = BASE.replace('kind = "grpc"', 'kind = "torch"') + entry("userprocs:Count", ["torch_reduce"], ["server"],
                                                                   path="reduced.txt")
    (folder / "exp.toml").write_text(text)
    started = time.monotonic()
    assert run_local("exp.toml", [], "runs/torch", quiet=True, show_table=False) == 0, time.monotonic() - started
    lines = _lines(folder / "reduced.txt")
    assert [(x["method"], x["round"]) for x in lines] == [("torch_reduce", r) for r in range(1, ROUNDS + 1)]


def test_a_config_processor_sees_every_upload_before_it_is_sent(folder):
    """direction = "out" at the clients: each client's reply to train, once per round it trains."""
    cfg = parse_config(BASE.replace("per_round = 5", "per_round = 3")
                       + entry("userprocs:Count", ["train"], ["client"], direction="out", path="up.txt"))
    summary, _ = run_inmemory(cfg, folder / "run")
    assert summary["status"] == "completed", summary["error"]
    lines = _lines(folder / "up.txt")
    assert {x["direction"] for x in lines} == {"out"} and Counter(x["round"] for x in lines) == {
        r: 3 for r in range(1, ROUNDS + 1)}                              # clients.per_round a round
    uploads = {(x["round"], x["who"].split(" upload of ")[1]) for x in lines}
    sampled = {(row["round"], row["dst"]) for row in RunStore(folder / "run" / "run.db").messages()
               if row["method"] == "train" and row["role"] == "sender" and row["src"] == "server"}
    assert uploads == sampled and len(uploads) == len(lines)   # each sampled client's reply, once
