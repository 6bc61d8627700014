"""`fedhop bench large` at a tiny size: its figures agree with each other and with closed forms.

The bench runs real processes (a server and one client process per client, gRPC on loopback)
from the user's folder; the figures are not asserted as speeds, only as consistent numbers.
"""
from __future__ import annotations

import json

import pytest
import torch

from fedhop.deploy.bench.bench_large import MB, SyntheticParams, SyntheticTask, estimate_bytes, main


def test_bench_large_tiny_figures_are_consistent(tmp_path, monkeypatch, capsys):
    size_mb, clients = 2, 2
    monkeypatch.chdir(tmp_path)   # a user's folder outside the repository, relative paths
    assert main(["--sizes", str(size_mb), "--clients", str(clients), "--repeats", "1", "--json", "out.json",
                 "--max-memory-gb", "100"]) == 0
    fig = json.loads((tmp_path / "out.json").read_text())
    (row,) = fig["rounds"]
    model = size_mb * MB // 4 * 4
    assert row["model_bytes"] == model and fig["skipped"] == []
    # the ledger's client-server link: the model down to every client, its update up from each
    assert row["down"]["tensor_bytes"] == clients * model
    assert row["up"]["tensor_bytes"] == clients * model
    for way in ("down", "up"):   # framing: headers, frame tags and gRPC prefixes, small beside the model
        assert 0 < row[way]["framed_bytes"] - row[way]["tensor_bytes"] < 2_000 * row[way]["messages"]
    # one step from w = 0 on f_i = 1/2 |w|^2 - t_i sum(w) is lr t_i; FedAvg's mean is exact in float32
    assert row["model_exact"] is True
    # the receiver of a model holds it: a client's peak memory exceeds the model and its start
    assert row["client_peak_rss_bytes"] > max(model, row["client_rss_at_start_bytes"] - 1)
    assert row["server_peak_rss_bytes"] > model
    assert row["round_seconds"] > 0 and row["server_cpu_s"] >= 0 and row["client_cpu_s"] >= 0
    (tr,) = fig["transfers"]
    assert tr["bytes"] == model and tr["grpc_mb_s"] > 0 and tr["bare_mb_s"] > 0
    assert abs(tr["grpc_over_bare"] - tr["grpc_mb_s"] / tr["bare_mb_s"]) < 1e-9
    assert model < tr["framed_bytes"] < model + 2_000
    for key in ("sender_cpu_ratio", "receiver_cpu_ratio", "grpc_sender_cpu_s_per_gb", "bare_receiver_cpu_s_per_gb"):
        assert key in tr and not tr[key] < 0   # NaN where a tiny transfer's CPU is under one clock tick
    assert "gRPC/bare" in capsys.readouterr().out and [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_bench_large_skips_what_does_not_fit(tmp_path, capsys):
    """A cell over the memory budget is skipped with its reason; nothing is started."""
    out = tmp_path / "out.json"
    assert main(["--sizes", "1000", "--clients", "8", "--max-memory-gb", "1", "--no-transfer", "--json", str(out)]) == 0
    fig = json.loads(out.read_text())
    assert fig["rounds"] == [] and len(fig["skipped"]) == 1
    assert f"{estimate_bytes(1000, 8) / 1e9:.1f} GB" in fig["skipped"][0]["reason"]
    assert "skipped" in capsys.readouterr().out


def test_bench_large_bad_flag_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--sizes", "big"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--sizes 'big'" in err and len(err.strip().splitlines()) == 1


def test_synthetic_task_gradient_is_w_minus_t():
    task = SyntheticTask(3, SyntheticParams(mb=0.0004).mb)   # 100 parameters
    model = task.build_model()
    with torch.enable_grad():
        loss = task.loss(model, task.client_data(2).tensors)
        loss.backward()
    assert model.w.numel() == 100 and bool((model.w.grad == -3.0).all())   # w - t_i at w = 0, t_2 = 3
    # at any w: autograd's own loss, and the gradient w - t correctly rounded (autograd's own adds
    # 1/2 w, 1/2 w and -t in its own order, so it may differ in the last bit)
    with torch.no_grad():
        model.w.copy_(torch.randn(100, generator=torch.Generator().manual_seed(4)) * 50)
    model.w.grad = None
    plain = model.w.detach().clone().requires_grad_()
    with torch.enable_grad():
        loss = task.loss(model, task.client_data(2).tensors)
        loss.backward()
        expect = 0.5 * torch.dot(plain, plain) - 3.0 * plain.sum()
        expect.backward()
    assert torch.equal(loss.detach(), expect.detach())
    assert torch.equal(model.w.grad, plain.detach() - 3.0) and torch.allclose(model.w.grad, plain.grad)


def test_bench_large_spreads_clients_over_fewer_processes(tmp_path, monkeypatch, capsys):
    """`--processes 2` with 4 clients: every client's update still crosses the client-server
    link (the ledger), the round is exact, and the estimate counts two client processes."""
    size_mb, clients = 2, 4
    monkeypatch.chdir(tmp_path)
    assert main(["--sizes", str(size_mb), "--clients", str(clients), "--processes", "2", "--no-transfer",
                 "--json", "out.json", "--max-memory-gb", "100"]) == 0
    (row,) = json.loads((tmp_path / "out.json").read_text())["rounds"]
    model = size_mb * MB // 4 * 4
    assert row["processes"] == 2 and row["clients"] == clients and row["model_exact"] is True
    assert row["down"]["tensor_bytes"] == clients * model and row["up"]["tensor_bytes"] == clients * model
    assert estimate_bytes(1000, 8, 2) < estimate_bytes(1000, 8)
    capsys.readouterr()
    for flags, named in ((["--processes", "0"], "--processes"), (["--chunk", "0"], "--chunk 0"),
                         (["--chunk", "-4"], "--chunk -4"), (["--max-memory-gb", "0"], "--max-memory-gb 0.0"),
                         (["--max-memory-gb", "nan"], "--max-memory-gb nan")):
        assert main(flags) == 2, flags
        err = capsys.readouterr().err
        assert named in err and len(err.strip().splitlines()) == 1, (flags, err)


def test_paired_transfers_take_turns():
    """deploy/bench/bench.py `paired`: one warm-up each, then repeat k starts with transfer k mod n, so a
    change of the machine's load falls on every transfer alike; each gets `repeats` timed calls."""
    from fedhop.deploy.bench.bench import Transfer, paired

    calls: list[tuple[str, int]] = []

    class Recorded(Transfer):
        def __init__(self, name: str) -> None:
            super().__init__(1 << 20, 1 << 20)
            self.name = name

        def start(self) -> None:
            self.receiver = None

        def call(self, i: int) -> float:
            calls.append((self.name, i))
            return float(len(calls))

        def receiver_cpu(self) -> float:
            return 0.0

    out = paired([Recorded("a"), Recorded("b"), Recorded("c")], repeats=4)
    assert calls[:3] == [("a", 0), ("b", 0), ("c", 0)]   # the warm-ups
    order = [name for name, _ in calls[3:]]
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert [i for _, i in calls[3:]] == [k for k in (1, 2, 3, 4) for _ in range(3)]
    assert {name: len(row["times"]) for name, row in out.items()} == {"a": 4, "b": 4, "c": 4}
    assert out["b"]["times"] == [5.0, 7.0, 12.0, 14.0]   # its calls' positions, as `call` returned them


def test_a_receiver_that_cannot_start_fails_paired_with_its_own_error(monkeypatch):
    """A transfer whose receiver process fails to start leaves `paired` raising that failure, not
    an error from stopping a process that never ran."""
    import multiprocessing

    from fedhop.deploy.bench import bench
    from fedhop.deploy.bench.bench import Transfer, paired

    class NoStart:
        def __init__(self, ctx) -> None:
            self.ctx = ctx

        def Queue(self):
            return self.ctx.Queue()

        def Process(self, *args, **kwargs):
            process = self.ctx.Process(*args, **kwargs)
            process.start = lambda: (_ for _ in ()).throw(OSError("no process could be started"))
            return process

    get_context = multiprocessing.get_context
    monkeypatch.setattr(bench.mp, "get_context", lambda method: NoStart(get_context(method)))

    class Spawned(Transfer):
        name = "spawned"

        def start(self) -> None:
            self._spawn(print)

    with pytest.raises(OSError, match="no process could be started"):
        paired([Spawned(1 << 20, 1 << 20)], repeats=1)
