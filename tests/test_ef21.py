"""EF21 around a compressor (`[compression] error_feedback = "ef21"`,
common/processors/compressors/ef21.py): the sender's estimate g_i and the parent's copy G_i equal
an independent numpy replay of g <- g + topk(v - g) after every upload; a lost reply is found by
the count, the upload refused (EF21_DESYNC) and both ends reset; a real gRPC run equals the
in-process engine bit for bit.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.config import parse_config
from fedhop.common.engine.rounds import RoundEngine
from fedhop.common.processors.compressors.ef21 import COUNT_KEY, ESTIMATE, RESET_KEY, message_for, take_reset
from fedhop.common.processors.compressors.sparse import TopK
from fedhop.common.processors.compressors.use import UploadCoding, decode_upload, encode_upload
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import Payload

K = 15
SPEC = {"w": (torch.float32, (20, 10)), "b": (torch.float32, (10,))}


def coding() -> UploadCoding:
    return UploadCoding(TopK(k=K), min_numel=2, feedback=False, edges=False, ef21=True)


def np_topk(v: np.ndarray, k: int) -> np.ndarray:
    flat, out = v.reshape(-1), np.zeros(v.size, dtype=v.dtype)
    keep = np.argsort(-np.abs(flat), kind="stable")[:k]
    out[keep] = flat[keep]
    return out.reshape(v.shape)


def updates(rounds: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        yield {"w": rng.normal(size=(20, 10)).astype(np.float32), "b": rng.normal(size=10).astype(np.float32)}


def send(state: dict, update: dict, round: int) -> Payload:
    payload = Payload(tensors={n: torch.from_numpy(v.copy()) for n, v in update.items()}, scalars={"weight": 1.0})
    return encode_upload(coding(), payload, seed=3, sender="client-1", round=round, step=0, state=state)


def test_estimates_equal_numpy_at_both_ends_after_every_upload():
    state: dict[str, torch.Tensor] = {}
    memory: dict[str, torch.Tensor] = {}
    g = {"w": np.zeros((20, 10), np.float32), "b": np.zeros(10, np.float32)}
    for r, update in enumerate(updates(12), start=1):
        coded = send(state, update, r)
        assert coded.scalars[COUNT_KEY] == r
        assert all(":" in n for n in coded.tensors)   # only parts travel
        got = decode_upload(coding(), coded, SPEC, memory, "client-1", f"round {r}")
        for n in g:
            g[n] = (g[n] + np_topk(update[n] - g[n], K)).astype(np.float32)   # Alg. 1 lines 5-6
            assert np.array_equal(state[ESTIMATE + n].numpy().reshape(g[n].shape), g[n]), (r, n)
            assert np.array_equal(got.tensors[n].numpy(), g[n]), (r, n)   # the parent hands on G_i = g_i
        assert COUNT_KEY not in got.scalars and got.scalars["weight"] == 1.0
    # the estimate tracks the updates: the last one is closer to g than to the zero start
    last = update
    assert np.linalg.norm(last["w"] - g["w"]) < np.linalg.norm(last["w"])


def test_a_lost_reply_is_refused_then_both_ends_start_again():
    state: dict[str, torch.Tensor] = {}
    memory: dict[str, torch.Tensor] = {}
    stream = updates(6, seed=1)
    for r in (1, 2):
        decode_upload(coding(), send(state, next(stream), r), SPEC, memory, "client-1", "ok")
    send(state, next(stream), 3)   # lost on the way: the sender applied it, the parent never saw it
    with pytest.raises(PayloadError) as err:
        decode_upload(coding(), send(state, next(stream), 4), SPEC, memory, "client-1", "round 4")
    assert err.value.code == "EF21_DESYNC"
    message = message_for(Payload(tensors={"w": torch.zeros(20, 10)}, scalars={"lr": 0.1}), memory, "client-1")
    assert message.scalars[RESET_KEY] is True and not any("client-1" in k for k in memory)
    assert message_for(message, memory, "client-1") is message   # one reset per refusal
    plain = take_reset(message, state)
    assert plain.scalars == {"lr": 0.1} and not state
    update = next(stream)
    got = decode_upload(coding(), send(state, update, 5), SPEC, memory, "client-1", "round 5")
    for n in update:   # from zero again: g = topk(v)
        assert np.array_equal(got.tensors[n].numpy(), np_topk(update[n], K))
        assert torch.equal(got.tensors[n].reshape(-1), state[ESTIMATE + n])


def test_an_upload_without_its_count_is_a_typed_error():
    state: dict[str, torch.Tensor] = {}
    coded = send(state, next(updates(1)), 1)
    bad = Payload(tensors=coded.tensors, scalars={"weight": 1.0})
    with pytest.raises(PayloadError) as err:
        decode_upload(coding(), bad, SPEC, {}, "client-1", "round 1")
    assert err.value.code == "BAD_SCALAR"


CONFIG = """
[run]
name = "ef21"
seed = 4
rounds = 5
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
count = 8
per_round = 3
processes = 2
[compression]
up = "topk"
k = 60
error_feedback = "ef21"
"""


def test_a_grpc_run_with_ef21_equals_the_engine_bit_for_bit(tmp_path):
    (tmp_path / "exp.toml").write_text(CONFIG)
    done = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "exp.toml", "--out", "runs/e", "--quiet"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    engine = RoundEngine(parse_config(CONFIG))
    engine.run()
    final = load_file(str(tmp_path / "runs" / "e" / "model.safetensors"))
    assert all(torch.equal(final[n], engine.state.params[n]) for n in final)
    copies = [k for k in engine.state.extra if k.startswith("ef21:client-")]
    assert copies   # the server's copies of the participants' estimates
