"""Device placement without a GPU (common/transport/placement.py, docs/gpus.md): the device specs, the
round-robin map of client processes to GPUs, the "no such device" refusal before any process
starts, and the seam's one crossing per received message, with the CPU standing in for a device.
The runs on real GPUs are tests/test_gpu.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedhop.common.config import ConfigError, parse_config
from fedhop.common.topologies.plan import plan_processes
from fedhop.common.transport import placement as td
from fedhop.transports.inmemory import endpoint as inmemory_transport


def test_resolve_specs_against_the_devices_a_machine_has():
    assert td.resolve("cpu", "k", count=0) == "cpu"
    assert td.resolve("auto", "k", count=0) == "cpu"
    assert td.resolve("auto", "k", count=3) == "cuda:0"
    assert td.resolve("cuda", "k", count=1) == "cuda:0"
    assert td.resolve("cuda:2", "k", count=3) == "cuda:2"
    with pytest.raises(td.DeviceError, match=r"'run.device' = 'cuda:3'.*3 CUDA device\(s\), cuda:0..cuda:2"):
        td.resolve("cuda:3", "run.device", count=3)
    with pytest.raises(td.DeviceError, match="'clients.device' = 'cuda': this machine has no CUDA device"):
        td.resolve("cuda", "clients.device", count=0)
    for bad in ("gpu", "cuda:", "cuda:-1", "CUDA", "cuda:0:1", ""):
        with pytest.raises(td.DeviceError, match="expected \"cpu\", \"cuda\""):
            td.resolve(bad, "edges.device", count=4)


@pytest.mark.parametrize("processes, gpus, per_gpu, count", [(5, [0, 1], 0, 2), (4, [], 0, 3), (7, [2, 0, 1], 3, 4),
                                                             (8, [1], 8, 2), (3, [], 1, 3)])
def test_client_processes_are_spread_round_robin(processes, gpus, per_gpu, count):
    devices = td.client_devices("cuda", gpus, per_gpu, processes, count=count)
    pool = gpus or list(range(count))
    assert devices == [f"cuda:{pool[k % len(pool)]}" for k in range(processes)]
    load = {d: devices.count(d) for d in devices}
    assert max(load.values()) - min(load.values()) <= 1          # balanced
    if per_gpu:
        assert max(load.values()) <= per_gpu
    assert td.client_devices("auto", gpus, per_gpu, processes, count=count) == devices
    assert td.client_devices("cpu", [], 0, processes, count=count) == ["cpu"] * processes
    assert td.client_devices("auto", [], 0, processes, count=0) == ["cpu"] * processes
    assert td.client_devices(f"cuda:{count - 1}", [], 0, processes, count=count) == [f"cuda:{count - 1}"] * processes


def test_client_gpu_map_refusals_name_the_key():
    with pytest.raises(td.DeviceError, match=r"'clients.gpus': no device 2; this machine has 2"):
        td.client_devices("cuda", [0, 2], 0, 4, count=2)
    with pytest.raises(td.DeviceError, match=r"'clients.processes_per_gpu' = 2: 5 client processes do not fit on 2"):
        td.client_devices("cuda", [0, 1], 2, 5, count=2)
    with pytest.raises(td.DeviceError, match="no CUDA device"):
        td.client_devices("cuda", [], 0, 2, count=0)
    with pytest.raises(td.DeviceError, match="either clients.gpus or"):
        td.client_devices("cuda:0", [1], 0, 2, count=2)


def test_config_keys_are_checked_when_the_config_is_read():
    base = '[clients]\ncount = 4\nprocesses = 2\n'
    cfg = parse_config(base, ["run.device=auto", "edges.device=cuda:1", "clients.device=cuda", "clients.gpus=[1, 0]",
                              "clients.processes_per_gpu=2"])
    assert (cfg.run.device, cfg.edges.device, cfg.clients.device, cfg.clients.gpus) == ("auto", "cuda:1", "cuda",
                                                                                        [1, 0])
    for override, key in (("run.device=gpu0", "run.device"), ("edges.device=cuda:x", "edges.device"),
                          ("clients.gpus=[0, 0]", "clients.gpus"), ("clients.gpus=[-1]", "clients.gpus"),
                          ("clients.gpus=[0]", "clients.gpus")):   # the last: clients.device is still "cpu"
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            parse_config(base, [override])


def test_plan_devices_put_each_process_of_a_hierarchical_plan_somewhere():
    cfg = parse_config('[topology]\nkind = "hierarchical"\nedges = 2\n[clients]\ncount = 8\nprocesses = 2\n',
                       ["run.device=cuda:1", "edges.device=auto", "clients.device=cuda", "clients.gpus=[1, 0]"])
    plan = plan_processes(cfg)
    devices = td.plan_devices(cfg, plan, count=2)
    assert devices["server"] == "cuda:1"
    assert [devices[e.node_id] for e in plan.edges] == ["cuda:0", "cuda:0"]
    clients = [p.node_id for p in plan.clients]
    assert [devices[c] for c in clients] == [["cuda:1", "cuda:0"][k % 2] for k in range(len(clients))]
    assert set(devices) == set(plan.node_ids)
    cfg.run.device, cfg.edges.device, cfg.clients.device = "auto", "auto", "auto"
    td.resolve_config(cfg, count=0)
    assert (cfg.run.device, cfg.edges.device, cfg.clients.device) == ("cpu", "cpu", "cpu")


@pytest.mark.skipif(td.cuda_count() > 0, reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("override, key", [("clients.device=cuda", "clients.device"),
                                           ("run.device=cuda:0", "run.device"),
                                           ("edges.device=cuda", "edges.device")])
def test_a_device_this_machine_lacks_is_refused_before_any_process_starts(tmp_path, override, key):
    (tmp_path / "exp.toml").write_text('[topology]\nkind = "hierarchical"\nedges = 1\n'
                                       '[run]\nrounds = 1\n[clients]\ncount = 2\nprocesses = 1\n')
    done = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "exp.toml", "--out", "runs/a",
                           "--set", override], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"'{key}'" in lines[0] and "no CUDA device" in lines[0], done.stderr
    assert not (tmp_path / "runs").exists()    # nothing was made, nothing started


def test_a_role_given_a_missing_device_exits_2_with_one_line(tmp_path):
    if td.cuda_count() > 0:
        pytest.skip("checks the refusal on a machine without CUDA")
    done = subprocess.run([sys.executable, "-m", "fedhop.client", "--parent", "127.0.0.1:9", "--clients", "0",
                           "--device", "cuda:0"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "'--device' = 'cuda:0': this machine has no CUDA device" in done.stderr


class StandInEndpoint(inmemory_transport.InMemoryEndpoint):
    """An in-memory endpoint whose "device" is the CPU: every received payload goes through the
    seam (`to_device`) as on a GPU, where the counter sees it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.device = torch.device("cpu")


@pytest.mark.parametrize("topology", ['kind = "star"', 'kind = "hierarchical"\nedges = 2'])
def test_a_tensor_crosses_the_seam_once_per_received_message(tmp_path, monkeypatch, topology):
    from fedhop.deploy.launch import inmemory, inprocess
    text = (f'[run]\nrounds = 3\nseed = 4\n[topology]\n{topology}\n[algorithm]\nname = "scaffold"\nlocal_steps = 3\n'
            '[clients]\ncount = 6\nper_round = 4\nprocesses = 2\n[transport]\nkind = "inmemory"\n')
    _, plain = inmemory.run_inmemory(parse_config(text), tmp_path / "plain")
    monkeypatch.setattr(inprocess, "InMemoryEndpoint", StandInEndpoint)   # where run_inmemory builds its endpoints
    td.CROSSINGS.clear()
    _, placed = inmemory.run_inmemory(parse_config(text), tmp_path / "placed")
    received = []
    for path in (tmp_path / "placed" / "ledger").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["role"] == "receiver" and rec["tensor_bytes"] > 0:
                received.append(rec)
    assert received and td.CROSSINGS["messages"] == len(received)
    # the stand-in changes where nothing lives: the same model, bit for bit
    for name, value in plain.state.params.items():
        assert torch.equal(value, placed.state.params[name]), name


def test_nccl_gives_every_process_its_own_gpu_or_refuses():
    cfg = parse_config('[topology]\nkind = "hierarchical"\nedges = 2\n[clients]\ncount = 8\nprocesses = 2\n'
                       '[transport]\nkind = "torch"\nbackend = "nccl"\n', ["clients.device=cpu"])
    plan = plan_processes(cfg)
    n = len(plan.node_ids)
    devices = td.plan_devices(cfg, plan, count=n + 1)
    assert [devices[node] for node in plan.node_ids] == [f"cuda:{k}" for k in range(n)]   # plan order, distinct
    with pytest.raises(td.DeviceError, match=rf"NCCL needs one GPU per process and this run has {n} processes "
                                             rf"\(server, edges, client processes\) for {n - 1} CUDA"):
        td.plan_devices(cfg, plan, count=n - 1)
    cfg.transport.options["backend"] = "gloo"
    assert set(td.plan_devices(cfg, plan, count=0).values()) == {"cpu"}


def test_a_placed_task_keeps_recent_clients_and_evaluates_like_the_task(monkeypatch):
    from fedhop.common.tasks import build_task
    from fedhop.common.tasks import placed as tp
    monkeypatch.setattr(tp, "DEVICE_CLIENTS", 3)
    for text in ('[clients]\ncount = 6\n', '[data]\ndataset = "quadratic"\ndim = 3\n[clients]\ncount = 6\n'):
        inner = build_task(parse_config(text))
        placed = tp.PlacedTask(inner, torch.device("cpu"))   # the CPU standing in for a device
        for cid in (0, 1, 2, 3, 1, 4):
            data = placed.client_data(cid)
            assert all(torch.equal(a, b) for a, b in zip(data.tensors, inner.client_data(cid).tensors))
        assert list(placed._clients) == [3, 1, 4]                  # the three most recently trained
        model = placed.build_model()
        assert placed.evaluate(model) == inner.evaluate(model)
        assert placed.train_loss(model) == inner.train_loss(model)
        assert placed.num_clients == inner.num_clients and placed.kind == inner.kind
    assert tp.place_task(inner, torch.device("cpu")) is inner        # on the CPU: the task itself


@pytest.mark.skipif(__import__("shutil").which("kubectl") is None, reason="needs kubectl (kustomize)")
def test_the_gpu_overlay_tells_every_pod_with_a_gpu_to_compute_on_it():
    import yaml
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(["kubectl", "kustomize", str(repo / "deploy" / "k8s" / "overlays" / "gpu")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with_gpu = 0
    for doc in yaml.safe_load_all(done.stdout):
        pod = ((doc or {}).get("spec") or {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []):
            if "nvidia.com/gpu" in container.get("resources", {}).get("limits", {}):
                with_gpu += 1
                env = {e["name"]: e.get("value") for e in container.get("env", [])}
                assert env.get("FEDHOP_DEVICE") == "cuda", (doc["metadata"]["name"], env)
    assert with_gpu >= 2    # the server and the clients


def test_bench_gpu_says_so_and_exits_0_without_cuda(tmp_path):
    if td.cuda_count() > 0:
        pytest.skip("tests/test_gpu.py runs the benchmark on a GPU")
    done = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "bench", "gpu", "--json", "g.json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "no CUDA device" in done.stdout
    assert json.loads((tmp_path / "g.json").read_text()) == {"cuda": False, "rows": []}
