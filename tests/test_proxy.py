"""A byte-corrupting and a connection-dropping TCP proxy between a client process and the server
(tests/netfault.py), over real gRPC sockets: corrupted payloads are rejected with CHECKSUM_MISMATCH,
truncated ones with a typed transport error, the run completes, and the final model is exactly
FedAvg over the results that arrived intact (no corrupted byte got in)."""
from __future__ import annotations

import numpy as np

from fedhop.common.config import parse_config
from fedhop.common.processors.validation import rejection_code
from fedhop.server.resilience import ledger_consistency
from tests.cluster import Cluster, failed_clients_by_round, fedavg_reference
from tests.helpers import quadratic_config
from tests.netfault import FaultProxy

RNG = np.random.default_rng(5)
DIM = 1024                                   # 4 KiB tensors: one large HTTP/2 DATA frame per message
CENTERS = RNG.normal(0, 2, size=(4, DIM))
CURV = RNG.uniform(0.5, 2.0, size=(4, DIM))
SIZES = [5, 9, 13, 7]
ROUNDS, STEPS, LR = 8, 2, 0.1
BEHIND = [2, 3]                              # the logical clients behind the proxy


def _run(tmp_path, mode: str, p: float, seed: int, directions=("down", "up")):
    cfg = parse_config(quadratic_config(CENTERS, CURV, SIZES, rounds=ROUNDS, local_steps=STEPS, lr=LR,
                                        name=f"proxy-{mode}"),
                       ["run.min_results=1", "run.call_timeout=10.0", "run.round_timeout=20.0", "run.eval_every=0"])
    cluster = Cluster(cfg, tmp_path)
    proxies: list[FaultProxy] = []

    def behind_proxy(address: str) -> str:
        proxies.append(FaultProxy(address, mode=mode, p=p, seed=seed, directions=directions))
        return proxies[-1].address

    try:
        cluster.add_client("client-proc0", [0, 1])
        cluster.add_client("client-proc1", BEHIND, advertise=behind_proxy)
        summary = cluster.run()
    finally:
        cluster.close()
        for px in proxies:
            px.close()
    return cluster, summary, proxies[0]


def _check_model(cluster) -> dict[int, set[int]]:
    store = cluster.store()
    left_out = failed_clients_by_round(store)
    assert all(ids <= set(BEHIND) for ids in left_out.values()), left_out   # honest direct clients never lost
    expected = fedavg_reference(CENTERS, CURV, SIZES, ROUNDS, STEPS, LR, left_out)
    np.testing.assert_allclose(cluster.coord.state.params["w"].double().numpy(), expected, rtol=1e-4, atol=1e-5)
    return left_out


def test_corrupting_proxy_payloads_rejected_with_checksum_mismatch(tmp_path):
    cluster, summary, proxy = _run(tmp_path, "corrupt", p=0.3, seed=4)
    assert summary["status"] == "completed" and summary["rounds_completed"] == ROUNDS
    corrupted = [e for e in proxy.events if e[1] == "corrupt"]
    assert {d for d, _, _ in corrupted} == {"down", "up"}, proxy.events   # both directions were hit
    store = cluster.store()
    rejected = store.events("rejected_payload")
    assert rejected and all(e["detail"].startswith("CHECKSUM_MISMATCH") for e in rejected), rejected
    assert not store.events("client_failed")            # every corruption was caught as such, none as a crash
    # each corrupted message costs at most one result (a message may span two DATA frames)
    assert 1 <= len(rejected) <= len(corrupted)
    assert summary["faults"]["rejections"] == {"CHECKSUM_MISMATCH": len(rejected)}
    assert summary["failures"] == len(rejected)
    left_out = _check_model(cluster)
    assert sum(len(v) for v in left_out.values()) == len(rejected)
    assert ledger_consistency(store)["ok"], ledger_consistency(store)


def test_corruption_goes_undetected_without_the_checksum_so_the_crc_matters(tmp_path):
    """Control experiment: with security.checksum = false the same proxy's flips reach the model."""
    cfg_text = quadratic_config(CENTERS, CURV, SIZES, rounds=3, local_steps=STEPS, lr=LR, name="nocrc")
    cfg = parse_config(cfg_text, ["run.min_results=1", "security.checksum=false", "run.eval_every=0"])
    cluster = Cluster(cfg, tmp_path)
    proxies: list[FaultProxy] = []

    def behind_proxy(address: str) -> str:
        proxies.append(FaultProxy(address, mode="corrupt", p=1.0, seed=0, directions=("up",)))
        return proxies[-1].address

    try:
        cluster.add_client("client-proc0", [0, 1])
        cluster.add_client("client-proc1", BEHIND, advertise=behind_proxy)
        assert not cluster.clients[1].endpoint.checksum        # the config turned the checksum off everywhere
        summary = cluster.run()
    finally:
        cluster.close()
        for px in proxies:
            px.close()
    assert summary["status"] == "completed"
    assert proxies[0].events                                   # bits were flipped ...
    assert not cluster.store().events("rejected_payload")      # ... nobody noticed ...
    exact = fedavg_reference(CENTERS, CURV, SIZES, 3, STEPS, LR, {})
    got = cluster.coord.state.params["w"].double().numpy()
    assert np.abs(got - exact).max() > 1e-3                    # ... and the model is wrong


def test_dropping_proxy_truncated_messages_are_typed_losses_and_the_run_completes(tmp_path):
    cluster, summary, proxy = _run(tmp_path, "drop", p=0.1, seed=7)
    assert summary["status"] == "completed" and summary["rounds_completed"] == ROUNDS
    drops = [e for e in proxy.events if e[1] == "drop"]
    assert drops, "the proxy never dropped a connection: raise p or change the seed"
    store = cluster.store()
    failed = store.events("client_failed") + store.events("rejected_payload")
    assert 1 <= len(failed) <= 2 * len(drops)           # a drop cuts at most the calls sharing that connection
    for e in failed:                                    # each names a typed cause
        assert rejection_code(e["detail"]) or any(c in e["detail"] for c in ("TRUNCATED", "UNAVAILABLE",
                                                                              "INTERNAL", "CANCELLED")), e
    assert summary["failures"] == len(failed)
    _check_model(cluster)
    assert ledger_consistency(store)["ok"], ledger_consistency(store)
