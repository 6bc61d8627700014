"""Tasks and models: closed forms, determinism, data preparation, registry and validation."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedhop.common.config.schema import Config
from fedhop.common.models import build_model
from fedhop.common.models.conv import CNN
from fedhop.common.tasks import (
    LogRegParams,
    NpzParams,
    QuadraticParams,
    Task,
    build_task,
    dataset_params_class,
    params_from_options,
)
from fedhop.common.tasks.quadratic import QuadraticTask
from fedhop.common.util.rng import torch_stream

REPO = Path(__file__).resolve().parents[1]

CENTERS = [[1.0, -2.0, 0.5], [3.0, 0.0, -1.0], [-1.0, 4.0, 2.0]]
CURVS = [[1.0, 2.0, 0.5], [3.0, 1.0, 1.0], [0.5, 0.5, 4.0]]
SIZES = [10, 30, 60]


def _cfg(dataset: str = "digits", **data: object) -> Config:
    cfg = Config()
    cfg.data.dataset = dataset
    for key, value in data.items():
        if hasattr(cfg.data, key):
            setattr(cfg.data, key, value)
        else:
            cfg.data.options[key] = value
    return cfg


def _quadratic_cfg(**options: object) -> Config:
    cfg = _cfg("quadratic", centers=CENTERS, curvatures=CURVS, sizes=SIZES, **options)
    cfg.clients.count = 3
    return cfg


# ---------------------------------------------------------------------------- quadratic
def test_quadratic_optimum_matches_gradient_descent() -> None:
    task = build_task(_quadratic_cfg(dtype="float64"))
    model = task.build_model()
    assert [n for n, _ in model.named_parameters()] == ["w"] and torch.all(model.w == 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for _ in range(300):  # full gradient descent on F = sum_i p_i f_i, via the task's own loss
        opt.zero_grad()
        total = sum(task.loss(model, task.client_data(i).tensors) * task.client_data(i).num_samples
                    for i in range(task.num_clients)) / sum(SIZES)
        total.backward()
        opt.step()
    w_star = task.optimum()
    torch.testing.assert_close(model.w.detach(), w_star, atol=1e-9, rtol=0)
    # independent closed form: w*_j = sum_i n_i c_ij a_ij / sum_i n_i c_ij
    a, c, n = np.array(CENTERS), np.array(CURVS), np.array(SIZES, float)[:, None]
    np.testing.assert_allclose(w_star.numpy(), (n * c * a).sum(0) / (n * c).sum(0), rtol=1e-12)
    metrics = task.evaluate(model)
    assert metrics["distance_to_opt"] < 1e-8
    assert metrics["objective"] == pytest.approx(task.optimal_value(), abs=1e-12)


def test_quadratic_loss_gradient_is_closed_form_and_objective_matches() -> None:
    task = build_task(_quadratic_cfg())
    w = torch.tensor([0.3, -1.2, 2.0])
    model = task.build_model()
    with torch.no_grad():
        model.w.copy_(w)
    for i in range(3):
        model.zero_grad()
        task.loss(model, task.client_data(i).tensors).backward()
        expected = torch.tensor(CURVS[i]) * (w - torch.tensor(CENTERS[i]))  # C_i (w - a_i)
        torch.testing.assert_close(model.w.grad, expected)
    f = [0.5 * sum(CURVS[i][j] * (w[j].item() - CENTERS[i][j]) ** 2 for j in range(3)) for i in range(3)]
    objective = sum(SIZES[i] * f[i] for i in range(3)) / sum(SIZES)
    metrics = task.evaluate(model)
    assert metrics["objective"] == pytest.approx(objective, rel=1e-6)
    assert metrics["train_loss"] == pytest.approx(Task.train_loss(task, model), rel=1e-6)
    assert task.client_data(1).num_samples == 30 and task.client_data(1).rows == 1


def test_quadratic_noise_is_unbiased_with_given_std() -> None:
    task = build_task(_quadratic_cfg(noise=0.5, dtype="float64"))
    model = task.build_model()
    batch = task.client_data(0).tensors
    gen = torch_stream(0, "client/0/batches")
    grads = []
    for _ in range(4000):
        model.zero_grad()
        task.loss(model, batch, gen).backward()
        grads.append(model.w.grad.clone())
    g = torch.stack(grads)
    exact = torch.tensor(CURVS[0], dtype=torch.float64) * (0 - torch.tensor(CENTERS[0], dtype=torch.float64))
    assert torch.all((g.mean(0) - exact).abs() < 4 * 0.5 / 4000 ** 0.5)
    assert torch.all((g.std(0) - 0.5).abs() < 0.03)
    model.zero_grad()  # no generator: no noise (evaluation path)
    task.loss(model, batch).backward()
    torch.testing.assert_close(model.w.grad, exact)


def test_quadratic_options_w0_generation_and_validation() -> None:
    task = build_task(_quadratic_cfg(w0=[1.0, 2.0, 3.0]))
    assert torch.equal(task.build_model().w.detach(), torch.tensor([1.0, 2.0, 3.0]))
    cfg = _cfg("quadratic", dim=4, spread=2.0, curvature_low=0.5, curvature_high=2.0)
    cfg.clients.count = 6
    t1, t2 = build_task(cfg), build_task(cfg)
    assert t1.centers.shape == (6, 4) and torch.equal(t1.centers, t2.centers)
    assert float(t1.curvatures.min()) >= 0.5 and float(t1.curvatures.max()) <= 2.0
    with pytest.raises(ValueError, match="clients.count"):
        bad = _quadratic_cfg()
        bad.clients.count = 4
        build_task(bad)
    with pytest.raises(ValueError, match=r"data.curvatures: expected shape \(3, 3\)"):
        QuadraticTask(CENTERS, [[1.0, 1.0]] * 3)
    with pytest.raises(ValueError, match="data.sizes"):
        QuadraticTask(CENTERS, CURVS, [1, 2])
    with pytest.raises(ValueError, match="data.w0"):
        QuadraticTask(CENTERS, CURVS, w0=[0.0])
    with pytest.raises(ValueError, match="unknown key 'centres'"):
        build_task(_quadratic_cfg(centres=[[1.0]]))
    with pytest.raises(ValueError, match="noise = -1.0: must be >= 0"):
        build_task(_quadratic_cfg(noise=-1.0))


# ---------------------------------------------------------------------------- determinism
def _fingerprint(task: Task) -> str:
    h = hashlib.sha256()
    for i in range(task.num_clients):
        data = task.client_data(i)
        h.update(str(data.num_samples).encode())
        for t in data.tensors:
            h.update(t.numpy().tobytes())
    for name, t in task.build_model().state_dict().items():
        h.update(name.encode() + t.numpy().tobytes())
    return h.hexdigest()


_CASES = {
    "digits-dirichlet-mlp": ("digits", "mlp", {"partition": "dirichlet", "alpha": 0.3}),
    "digits-shards-cnn": ("digits", "cnn", {"partition": "shards"}),
    "breast-iid-logreg": ("breast_cancer", "logreg", {"partition": "iid"}),
    "logreg-synthetic": ("logreg", "logreg", {"alpha": 0.5, "beta": 0.5}),
}


def _case_cfg(name: str, seed: int = 7) -> Config:
    dataset, kind, data = _CASES[name]
    cfg = _cfg(dataset, **data)
    cfg.model.kind = kind
    cfg.run.seed = seed
    return cfg


@pytest.mark.parametrize("case", sorted(_CASES))
def test_two_builds_give_identical_data_and_init(case: str) -> None:
    a, b = build_task(_case_cfg(case)), build_task(_case_cfg(case))
    assert a.num_clients == b.num_clients == 10
    for i in range(a.num_clients):
        for ta, tb in zip(a.client_data(i).tensors, b.client_data(i).tensors):
            assert torch.equal(ta, tb)
    sa, sb = a.build_model().state_dict(), b.build_model().state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    other = build_task(_case_cfg(case, seed=8))
    assert _fingerprint(other) != _fingerprint(a)


def test_task_identical_in_a_separate_process() -> None:
    code = ("import sys; from tests.test_tasks import _case_cfg, _fingerprint; "
            "from fedhop.common.tasks import build_task; "
            "print(' '.join(_fingerprint(build_task(_case_cfg(c))) for c in sys.argv[1:]))")
    cases = ["digits-dirichlet-mlp", "logreg-synthetic"]
    out = subprocess.run([sys.executable, "-c", code, *cases], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [_fingerprint(build_task(_case_cfg(c))) for c in cases]


def test_build_model_leaves_global_rng_untouched() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_task(_case_cfg("digits-dirichlet-mlp")).build_model()
    assert torch.equal(torch.rand(3), expected)


# ---------------------------------------------------------------------------- classification data
def test_digits_split_and_standardisation_support_a_good_linear_classifier() -> None:
    from sklearn.linear_model import LogisticRegression

    task = build_task(_cfg("digits", partition="dirichlet", alpha=0.5))
    x = torch.cat([task.client_data(i).tensors[0] for i in range(task.num_clients)]).numpy()
    y = torch.cat([task.client_data(i).tensors[1] for i in range(task.num_clients)]).numpy()
    assert len(x) + len(task.x_test) == 1797 and len(task.x_test) == pytest.approx(0.25 * 1797, abs=10)
    varying = x.std(0) > 0
    np.testing.assert_allclose(x.mean(0), 0.0, atol=1e-5)            # train-split statistics
    np.testing.assert_allclose(x.std(0)[varying], 1.0, atol=1e-4)
    clf = LogisticRegression(max_iter=2000).fit(x, y)
    assert clf.score(task.x_test.numpy(), task.y_test.numpy()) > 0.9


def test_evaluate_and_train_loss_agree_with_direct_computation() -> None:
    cfg = _case_cfg("digits-shards-cnn")
    task = build_task(cfg)
    model = task.build_model()
    assert task.client_data(0).tensors[0].shape[1:] == (1, 8, 8)
    with torch.no_grad():
        logits = model(task.x_test)
    metrics = task.evaluate(model)
    assert metrics["test_accuracy"] == pytest.approx(float((logits.argmax(1) == task.y_test).float().mean()))
    assert metrics["test_loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, task.y_test)),
                                                 rel=1e-5)
    assert task.train_loss(model) == pytest.approx(Task.train_loss(task, model), rel=1e-5)
    hist = task.label_histograms()
    assert (hist > 0).sum(1).max() <= cfg.data.shards_per_client


def test_mnist_task_uses_idx_test_files(tmp_path: Path) -> None:
    from fedhop.common.data.datasets import write_idx

    rng = np.random.default_rng(0)
    write_idx(tmp_path / "train-images-idx3-ubyte", rng.integers(0, 256, (200, 28, 28), dtype=np.uint8))
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.arange(200, dtype=np.uint8) % 10)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", rng.integers(0, 256, (30, 28, 28), dtype=np.uint8))
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.arange(30, dtype=np.uint8) % 10)
    cfg = _cfg("mnist", data_dir=str(tmp_path), partition="iid")
    cfg.model.kind = "cnn"
    task = build_task(cfg)
    assert task.source.startswith("idx:") and task.x_test.shape == (30, 1, 28, 28)
    assert sum(task.client_data(i).num_samples for i in range(10)) == 200
    assert task.build_model()(task.x_test).shape == (30, 10)


def test_cnn_on_tabular_data_is_rejected() -> None:
    cfg = _cfg("breast_cancer")
    cfg.model.kind = "cnn"
    with pytest.raises(ValueError, match="needs image data"):
        build_task(cfg)


# ---------------------------------------------------------------------------- synthetic logreg
def test_logreg_heterogeneity_and_sizes() -> None:
    def client_means(**opts: object) -> np.ndarray:
        cfg = _cfg("logreg", samples_sigma=0.5, **opts)
        cfg.clients.count = 20
        task = build_task(cfg)
        assert task.model_spec.input_shape == (60,) and task.n_classes == 10
        return np.stack([task.client_data(i).tensors[0].numpy().mean(0) for i in range(20)])

    hetero = client_means(alpha=1.0, beta=1.0)
    iid = client_means(iid=True)
    # feature means v_k ~ N(B_k, 1) differ across clients; under iid they are all ~0
    assert hetero.std(0).mean() > 0.8 and iid.std(0).mean() < 0.3
    cfg = _cfg("logreg", sizes=[100, 200, 40], samples_min=2)
    cfg.clients.count = 3
    task = build_task(cfg)
    assert [task.client_data(i).num_samples for i in range(3)] == [75, 150, 30]  # 25% held out
    assert len(task.y_test) == 25 + 50 + 10


def test_logreg_labels_follow_a_linear_rule_under_iid() -> None:
    from sklearn.linear_model import LogisticRegression

    cfg = _cfg("logreg", iid=True, dim=10, classes=3, sizes=[400] * 5)
    cfg.clients.count = 5
    task = build_task(cfg)
    x = task.x.numpy()
    clf = LogisticRegression(C=100.0, max_iter=5000).fit(x, task.y.numpy())
    assert clf.score(task.x_test.numpy(), task.y_test.numpy()) > 0.9


# ---------------------------------------------------------------------------- npz user data
def test_npz_regression_distance_to_opt(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    w_true = np.array([1.0, -2.0, 0.5])
    arrays = {}
    for i in range(3):
        x = rng.normal(size=(20, 3))
        arrays[f"x_{i}"], arrays[f"y_{i}"] = x, x @ w_true
    np.savez(tmp_path / "reg.npz", **arrays, w_true=w_true)
    cfg = _cfg("npz", data_dir=str(tmp_path), path="reg.npz", task="regression", bias=False)
    cfg.clients.count = 3
    cfg.model.kind = "linear"
    task = build_task(cfg)
    model = task.build_model()
    assert [n for n, _ in model.named_parameters()] == ["linear.weight"]
    with torch.no_grad():
        model.linear.weight.copy_(torch.tensor(w_true, dtype=torch.float32)[None])
    metrics = task.evaluate(model)
    assert metrics["distance_to_opt"] < 1e-6 and metrics["train_loss"] < 1e-10
    with torch.no_grad():
        model.linear.weight.zero_()
    assert task.evaluate(model)["distance_to_opt"] == pytest.approx(np.linalg.norm(w_true), rel=1e-6)
    x0, y0 = task.client_data(0).tensors
    assert task.loss(model, (x0, y0)).item() == pytest.approx(0.5 * float((y0 ** 2).mean()), rel=1e-6)


def test_npz_classification_with_test_set(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    arrays = {f"{s}_{i}": v for i in range(2) for s, v in
              (("x", rng.normal(size=(8, 4))), ("y", rng.integers(0, 3, 8)))}
    np.savez(tmp_path / "cls.npz", **arrays, x_test=rng.normal(size=(5, 4)), y_test=np.array([0, 1, 2, 1, 0]))
    cfg = _cfg("npz", path=str(tmp_path / "cls.npz"))
    cfg.clients.count = 2
    cfg.model.kind = "logreg"
    task = build_task(cfg)
    assert task.n_classes == 3 and torch.equal(task.client_data(1).tensors[1], torch.tensor(arrays["y_1"]))
    assert set(task.evaluate(task.build_model())) == {"test_accuracy", "test_loss"}
    cfg.clients.count = 3
    with pytest.raises(ValueError, match="holds 2 clients"):
        build_task(cfg)


@pytest.mark.parametrize("y_1, message", [
    (np.array([0.0, 1.0, np.inf, 0.0]), "classification labels must be 1-D integers"),
    (np.array([0, 1, 10**9, 0]), "label 1000000000 implies 1000000001 classes; at most 100000"),
])
def test_npz_labels_that_are_not_a_class_index_are_refused_naming_the_file(tmp_path: Path, monkeypatch, y_1,
                                                                           message) -> None:
    """An inf label or one implying a billion classes: one ValueError naming the file, no model built."""
    monkeypatch.chdir(tmp_path)
    np.savez("cls.npz", x_0=np.zeros((4, 2)), y_0=np.array([0, 1, 2, 0]), x_1=np.zeros((4, 2)), y_1=y_1)
    cfg = _cfg("npz", path="cls.npz")
    cfg.clients.count = 2
    with pytest.raises(ValueError, match=r"cls\.npz: ") as err:
        build_task(cfg)
    assert message in str(err.value)


# ---------------------------------------------------------------------------- models and registry
def test_model_names_shapes_and_zero_init() -> None:
    names = {kind: list(build_model(kind, (1, 8, 8), 10, [32, 16]).state_dict()) for kind in ("logreg", "mlp", "cnn")}
    assert names["logreg"] == ["linear.weight", "linear.bias"]
    assert names["mlp"] == ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias",
                            "out.weight", "out.bias"]
    assert names["cnn"] == ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                            "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert CNN(1, 28, 10)(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert CNN(1, 8, 10)(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    zero = build_model("mlp", (64,), 10, [16], init="zeros")
    assert all(float(p.detach().abs().sum()) == 0.0 for p in zero.parameters())
    a, b = build_model("mlp", (64,), 10, [16], seed=1), build_model("mlp", (64,), 10, [16], seed=2)
    assert not torch.equal(a.out.weight, b.out.weight)
    with pytest.raises(ValueError, match="allowed: char_lstm, cifar_cnn, cnn, leaf_cnn, linear, logreg, mcmahan_cnn, mlp"):
        build_model("resnet", (64,), 10)


def test_dataset_params_registry() -> None:
    assert dataset_params_class("quadratic") is QuadraticParams and dataset_params_class("logreg") is LogRegParams
    assert dataset_params_class("npz") is NpzParams and dataset_params_class("digits") is None
    p = params_from_options(LogRegParams, {"alpha": 1, "dim": 5}, "data")
    assert p.alpha == 1.0 and isinstance(p.alpha, float) and p.dim == 5
    with pytest.raises(ValueError, match=r"data.dim = 'x': expected int"):
        params_from_options(LogRegParams, {"dim": "x"}, "data")
    with pytest.raises(ValueError, match="allowed: classification, regression"):
        params_from_options(NpzParams, {"task": "ranking"}, "data")
    with pytest.raises(ValueError, match="takes no extra keys"):
        build_task(_cfg("digits", centers=[[1.0]]))
    with pytest.raises(ValueError, match="unknown data set 'no_such_dataset'"):
        dataset_params_class("no_such_dataset")
