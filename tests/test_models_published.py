"""The benchmark models: parameter counts against the published figures and closed forms."""
from __future__ import annotations

import pytest
import torch

from fedhop.common.models import build_model, num_parameters


def conv(c_in: int, c_out: int, k: int, bias: bool = True) -> int:
    return c_in * c_out * k * k + (c_out if bias else 0)


def dense(a: int, b: int) -> int:
    return a * b + b


def two_conv_cnn(classes: int, fc: int, c: int = 1, hw: int = 28) -> int:
    return conv(c, 32, 5) + conv(32, 64, 5) + dense(64 * (hw // 4) ** 2, fc) + dense(fc, classes)


def resnet18(classes: int, c: int = 3) -> int:
    """He et al.'s ResNet-18 (CIFAR stem): conv3x3 + norm, 4 stages of 2 basic blocks, FC; every
    norm has a scale and a shift per channel, convolutions have no bias."""
    total = conv(c, 64, 3, bias=False) + 2 * 64
    c_in = 64
    for width in (64, 128, 256, 512):
        for block in range(2):
            total += conv(c_in, width, 3, False) + 2 * width + conv(width, width, 3, False) + 2 * width
            if c_in != width:
                total += conv(c_in, width, 1, False) + 2 * width
            c_in = width
    return total + dense(512, classes)


def lstm_layer(i: int, h: int) -> int:
    return 4 * h * (i + h) + 2 * 4 * h       # torch: two bias vectors per gate


def test_mcmahan_cnn_has_the_published_count() -> None:
    # McMahan et al. 2017: "a total of 1,663,370 parameters" (MNIST, 10 classes)
    model = build_model("mcmahan_cnn", (1, 28, 28), 10)
    assert num_parameters(model) == two_conv_cnn(10, 512) == 1_663_370


def test_leaf_cnn_has_the_published_femnist_count() -> None:
    # LEAF's FEMNIST CNN (2048-unit FC, 62 classes): 6,603,710 parameters
    model = build_model("leaf_cnn", (1, 28, 28), 62)
    assert num_parameters(model) == two_conv_cnn(62, 2048) == 6_603_710
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 62)


def test_resnet18_groupnorm_count_and_no_running_statistics() -> None:
    model = build_model("resnet18_gn", (3, 32, 32), 10)
    assert num_parameters(model) == resnet18(10) == 11_173_962
    # GroupNorm keeps no buffers: every state_dict entry is a trained parameter (what FedAvg averages)
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters()}
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_cifar_cnn_count() -> None:
    model = build_model("cifar_cnn", (3, 32, 32), 10)
    expected = conv(3, 64, 5) + conv(64, 64, 5) + dense(64 * 8 * 8, 384) + dense(384, 192) + dense(192, 10)
    assert num_parameters(model) == expected == 1_756_426


def test_char_lstm_count_and_next_character_logits() -> None:
    model = build_model("char_lstm", (80,), 80)
    expected = 80 * 8 + lstm_layer(8, 256) + lstm_layer(256, 256) + dense(256, 80)
    assert num_parameters(model) == expected == 819_920
    x = torch.randint(0, 80, (4, 80)).float()          # tasks hand indices as float32
    assert model(x).shape == (4, 80)


@pytest.mark.parametrize("kind,shape", [("leaf_cnn", (80,)), ("char_lstm", (1, 28, 28))])
def test_wrong_input_shape_is_named(kind: str, shape: tuple) -> None:
    with pytest.raises(ValueError, match=kind):
        build_model(kind, shape, 10)


def test_same_seed_same_initial_weights() -> None:
    a, b = (build_model("cifar_cnn", (3, 32, 32), 10, seed=5) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_threads_building_at_once_get_the_seeded_weights(monkeypatch) -> None:
    """Two threads of one process (the in-memory clients) building the same seeded model at once.
    Each waits inside its construction for the other (a timeout releases it when the other cannot
    enter), so without the build lock the second reseeds the process's RNG while the first is still
    drawing from it, and one of them gets other weights than the seed gives."""
    import threading

    from fedhop.common.models import dense as dense_models

    first_inside, second_inside, first_done = threading.Event(), threading.Event(), threading.Event()
    entered: list[str] = []

    class InterleavingMLP(dense_models.MLP):   # type: ignore[misc, name-defined]
        def __init__(self, *args, **kwargs) -> None:
            torch.rand(1)                                 # the draws before the other thread runs
            me = "first" if not entered else "second"
            entered.append(me)
            if me == "first":
                first_inside.set()
                second_inside.wait(timeout=1.0)           # set at once without the lock; times out with it
            else:
                second_inside.set()
                first_done.wait(timeout=1.0)
            super().__init__(*args, **kwargs)
            if me == "first":
                first_done.set()

    monkeypatch.setattr(dense_models, "MLP", InterleavingMLP)
    expected = build_model("mlp", (6,), 3, hidden=(5,), seed=11).state_dict()
    entered.clear()
    first_inside.clear(), second_inside.clear(), first_done.clear()
    built: list[dict[str, torch.Tensor]] = []

    def build() -> None:
        built.append(build_model("mlp", (6,), 3, hidden=(5,), seed=11).state_dict())

    first = threading.Thread(target=build)
    first.start()
    assert first_inside.wait(timeout=30)
    second = threading.Thread(target=build)
    second.start()
    first.join(timeout=30)
    second.join(timeout=30)
    assert entered == ["first", "second"] and len(built) == 2
    for weights in built:
        assert all(torch.equal(weights[k], expected[k]) for k in expected)


def test_a_model_built_inside_another_build_does_not_deadlock(monkeypatch) -> None:
    """A user's factory may build a built-in model inside its own build (the lock is re-entrant);
    the inner build is seeded too and the outer draws go on from the outer seed."""
    import threading

    from fedhop.common.models import dense as dense_models

    inner: list[dict[str, torch.Tensor]] = []

    class Wrapping(dense_models.MLP):   # type: ignore[misc, name-defined]
        def __init__(self, *args, **kwargs) -> None:
            inner.append(build_model("logreg", (4,), 2, seed=9).state_dict())
            super().__init__(*args, **kwargs)

    plain = build_model("mlp", (6,), 3, hidden=(5,), seed=11).state_dict()
    monkeypatch.setattr(dense_models, "MLP", Wrapping)
    built: list[dict[str, torch.Tensor]] = []
    worker = threading.Thread(target=lambda: built.append(build_model("mlp", (6,), 3, hidden=(5,),
                                                                             seed=11).state_dict()), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive() and len(built) == 1
    assert all(torch.equal(built[0][k], plain[k]) for k in plain)
    assert all(torch.equal(inner[0][k], v) for k, v in build_model("logreg", (4,), 2, seed=9).state_dict().items())
