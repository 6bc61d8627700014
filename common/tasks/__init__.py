"""Task registry: `build_task(cfg)` turns a validated config into a `Task`.

Every process (server, edges, client hosts) calls `build_task` on the same resolved config and
gets the same task: data loading, the train/test split, the partition and the model's initial
parameters are all functions of the config and its seed (DESIGN.md section 8).  Build the task
once per process and share it between the logical clients it hosts.

Random streams used here: "data/split" (train/test split), "partition" (client partition),
"model/init" (initial parameters), "data/<dataset>/..." (synthetic data).

Data sets: every module of this package that defines data sets (and this one, for the tabular,
MNIST, quadratic, logreg and npz sets below) lists them in `REGISTER = {"name": (build, Params)}`,
`build(cfg, params) -> Task` and `Params` the dataclass of its extra [data] keys (None: it takes
none).  `DATASETS` is a common/util/registry.py `Registry`, the shape of every family's table: it
reads the names from the modules' sources and imports a module (a torch, torchvision or LEAF
task) only when one of its names is asked for or the full list is needed; a name that no module
declares is a user's plug-in, found by the same lookup: an import path `"pkg.module:load"` or an
entry point of group `fedhop.datasets` (common/util/plugins.py; `_build_plugin` below turns its
per-client data into a task).  `register_dataset` adds one from Python.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from fedhop.common.data import datasets, partition
from fedhop.common.models.exchange import with_model_selection
from fedhop.common.tasks.base import ClientData, Task
from fedhop.common.tasks.classification import ArrayTask, ClassificationTask, ModelSpec, RegressionTask
from fedhop.common.tasks.logreg import LogRegParams, LogRegTask
from fedhop.common.tasks.quadratic import QuadraticParams, QuadraticTask, generate_problem
from fedhop.common.util.plugins import DataRequest, FederatedData, PluginError
from fedhop.common.util.registry import Registry
from fedhop.common.util.rng import numpy_stream, stream_seed
from fedhop.common.util.suggest import did_you_mean

__all__ = [
    "Task", "ClientData", "ArrayTask", "ClassificationTask", "RegressionTask", "QuadraticTask",
    "LogRegTask", "ModelSpec", "NpzParams", "QuadraticParams", "LogRegParams", "DATASETS", "DataSet",
    "build_task", "builtin_datasets", "register_dataset", "dataset_params_class", "dataset_params", "params_from_options",
]

#: Dirichlet resampling budget used by build_task (each try costs ~0.2 ms on digits).
DIRICHLET_MAX_TRIES = 10_000


MAX_NPZ_CLASSES = 100_000
"""The most classes npz classification data may have: a larger label is a mistake (a float value, an
id) that would otherwise build a model with that many outputs."""


@dataclass
class NpzParams:
    """[data] keys of dataset = "npz" (the user's own federated data).

    `task`: "classification" (integer labels 0..C-1, at most 100000 classes) or "regression"
    """

    path: str = field(default="", metadata={"path": True})  # relative paths are looked up in data.data_dir, then the cwd
    task: str = field(default="classification", metadata={"choices": ("classification", "regression")})
    standardize: bool = False      # user data is used as given unless asked
    bias: bool = True              # regression: fit an intercept


Builder = Callable[[Any, Any], Task]


class DataSet(typing.NamedTuple):
    """A data set's entry: its builder and the dataclass of its extra [data] keys (None: none)."""

    build: Builder
    params: type | None


def _builtin(name: str, raw: Any, module: str) -> DataSet:
    """A module's `REGISTER` value `(build, Params)` as an entry."""
    build, params = raw
    return DataSet(build, params)


def _dataset_plugin(ref: str, load: Any) -> DataSet:
    """A data-set plug-in (`load(request) -> FederatedData | Task`) as an entry."""
    if not callable(load):
        raise PluginError(f"data.dataset = {ref!r} is a {type(load).__name__}, not a function")
    return DataSet(_build_plugin(load), getattr(load, "Params", None))


DATASETS: Registry[DataSet] = Registry("data set", __name__, "datasets", check=_builtin, plugin=_dataset_plugin,
                                       keep=True, what="function", order=lambda name, _: name)


def register_dataset(name: str, build: Builder, params: type | None = None) -> None:
    """Add `build(cfg, params) -> Task` as `[data] dataset = name` from Python (a built-in is a
    module's `REGISTER` entry; a config's plug-in is found by `DATASETS.get`)."""
    DATASETS.add(name, DataSet(build, params))


def builtin_datasets() -> list[str]:
    """The names of the built-in data sets, sorted (the config reference lists their keys,
    deploy/cli/configref.py): not the plug-ins this process has loaded."""
    return DATASETS.names()


def dataset_params_class(name: str) -> type | None:
    """The dataclass of `name`'s extra [data] keys, or None when it takes none."""
    return DATASETS.get(name).params


# ---------------------------------------------------------------------------- params
def _check_value(where: str, f: dataclasses.Field, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint) or hint
    if origin is bool:
        ok = isinstance(value, bool)
    elif origin is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif origin is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif origin is str:
        ok = isinstance(value, str)
    elif origin is list:
        ok = isinstance(value, (list, tuple))
        value = list(value) if ok else value
    else:
        ok = True
    if not ok:
        raise ValueError(f"{where}.{f.name} = {value!r}: expected {getattr(origin, '__name__', hint)}")
    rules = f.metadata
    if "choices" in rules and value not in rules["choices"]:
        raise ValueError(f"{where}.{f.name} = {value!r} is not allowed{did_you_mean(value, rules['choices'])} "
                         f"(allowed: {', '.join(map(str, rules['choices']))})")
    if "min" in rules and value < rules["min"]:
        raise ValueError(f"{where}.{f.name} = {value!r}: must be >= {rules['min']}")
    if "min_exclusive" in rules and value <= rules["min_exclusive"]:
        raise ValueError(f"{where}.{f.name} = {value!r}: must be > {rules['min_exclusive']}")
    if "max" in rules and value > rules["max"]:
        raise ValueError(f"{where}.{f.name} = {value!r}: must be <= {rules['max']}")
    if "max_exclusive" in rules and value >= rules["max_exclusive"]:
        raise ValueError(f"{where}.{f.name} = {value!r}: must be < {rules['max_exclusive']}")
    return value


def params_from_options(cls: type, options: dict, where: str = "data") -> Any:
    """Build `cls` from a dict of config keys; names the key, the value and what is allowed."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in options.items():
        if key not in fields:
            raise ValueError(f"{where}: unknown key '{key}'{did_you_mean(key, fields)} (allowed: {', '.join(sorted(fields))})")
        values[key] = _check_value(where, fields[key], hints[key], value)
    return cls(**values)


def dataset_params(cfg: Any) -> Any:
    """The data set's Params: `cfg.data.params` when the config loader set it, else built
    from `cfg.data.options`."""
    name = cfg.data.dataset
    cls = dataset_params_class(name)
    given = getattr(cfg.data, "params", None)
    if cls is None:
        extra = given if isinstance(given, dict) else dict(getattr(cfg.data, "options", {}) or {})
        if extra:
            raise ValueError(f"data: dataset '{name}' takes no extra keys, got {', '.join(sorted(extra))}")
        return None
    if isinstance(given, cls):
        return given
    if isinstance(given, dict):
        return params_from_options(cls, given, f"data ({name})")
    return params_from_options(cls, dict(getattr(cfg.data, "options", {}) or {}), f"data ({name})")


# ---------------------------------------------------------------------------- shared steps
def model_spec(cfg: Any, input_shape: tuple[int, ...], n_outputs: int, bias: bool = True) -> ModelSpec:
    return ModelSpec(kind=cfg.model.kind, input_shape=tuple(int(s) for s in input_shape),
                     n_outputs=int(n_outputs), hidden=tuple(int(h) for h in cfg.model.hidden),
                     init=cfg.model.init, seed=stream_seed(cfg.run.seed, "model/init"), bias=bias,
                     factory=cfg.model.factory, factory_args=tuple(sorted(cfg.model.factory_args.items())))


def make_partition(cfg: Any, labels: np.ndarray) -> list[np.ndarray]:
    """Split training indices among `clients.count` clients per `[data] partition`."""
    rng = numpy_stream(cfg.run.seed, "partition")
    k, d = int(cfg.clients.count), cfg.data
    if d.partition == "iid":
        if len(labels) < k:
            raise ValueError(f"clients.count = {k} exceeds the {len(labels)} training samples")
        return partition.iid(len(labels), k, rng)
    if d.partition == "dirichlet":
        return partition.dirichlet(labels, k, d.alpha, rng, min_size=d.min_size, max_tries=DIRICHLET_MAX_TRIES)
    if d.partition == "shards":
        return partition.shards(labels, k, d.shards_per_client, rng)
    if d.partition in ("lognormal", "pareto"):
        return partition.size_skewed(len(labels), k, d.partition, rng, sigma=d.skew_sigma, shape=d.skew_shape,
                                     min_size=max(1, d.min_size))
    if d.partition == "natural":
        raise ValueError(f"data.partition = 'natural': dataset {d.dataset!r} has no natural clients (writers or "
                         f"speakers); natural needs femnist, shakespeare or sent140 (allowed here: iid, dirichlet, "
                         f"shards, lognormal, pareto)")
    raise ValueError(f"data.partition = {d.partition!r} is not allowed (allowed: {', '.join(partition.PARTITIONS)})")


def standardize(x_train: np.ndarray, *others: np.ndarray) -> list[np.ndarray]:
    """(x - mean) / std per feature with mean/std from the training split only (std 0 -> 1)."""
    mean = x_train.mean(0, dtype=np.float64)
    std = x_train.std(0, dtype=np.float64)
    std[std == 0] = 1.0
    return [((a - mean) / std).astype(np.float32) for a in (x_train, *others)]


def _split(cfg: Any, x: np.ndarray, y: np.ndarray):
    return datasets.train_test_split(x, y, cfg.data.test_fraction, numpy_stream(cfg.run.seed, "data/split"))


def _classification(cfg: Any, name: str, x_tr, y_tr, x_te, y_te, n_classes: int) -> ClassificationTask:
    parts = make_partition(cfg, y_tr)
    spec = model_spec(cfg, x_tr.shape[1:], n_classes)
    return ClassificationTask(x_tr, y_tr, parts, spec, x_te, y_te, name=name, n_classes=n_classes)


# ---------------------------------------------------------------------------- builders
def _build_tabular(loader: Callable[[], tuple[np.ndarray, np.ndarray]], name: str,
                   image_hw: tuple[int, int] | None) -> Builder:
    def build(cfg: Any, _params: Any) -> Task:
        x, y = loader()
        x_tr, y_tr, x_te, y_te = _split(cfg, x, y)
        if cfg.data.standardize:
            x_tr, x_te = standardize(x_tr, x_te)
        if cfg.model.kind == "cnn":
            if image_hw is None:
                raise ValueError(f"model.kind = 'cnn' needs image data; dataset '{name}' is tabular "
                                 f"(allowed: linear, logreg, mlp)")
            x_tr, x_te = (a.reshape(-1, 1, *image_hw) for a in (x_tr, x_te))
        return _classification(cfg, name, x_tr, y_tr, x_te, y_te, int(y.max()) + 1)
    return build


def idx_task(cfg: Any, data: Any, name: str) -> ClassificationTask:
    """A 10-class task from IDX files (MNIST, Fashion-MNIST): their own test split when present."""
    if data.x_test is not None:
        x_tr, y_tr, x_te, y_te = data.x, data.y, data.x_test, data.y_test
    else:
        x_tr, y_tr, x_te, y_te = _split(cfg, data.x, data.y)
    task = _classification(cfg, name, x_tr, y_tr, x_te, y_te, 10)
    task.source = data.source
    return task


def _build_mnist(cfg: Any, _params: Any) -> Task:
    return idx_task(cfg, datasets.load_mnist(cfg.data.data_dir), "mnist")


def _build_quadratic(cfg: Any, p: QuadraticParams) -> Task:
    centers: list | np.ndarray
    curvatures: list | np.ndarray
    centers, curvatures = p.centers, p.curvatures
    if not centers:
        centers, curvatures = generate_problem(p, int(cfg.clients.count), numpy_stream(cfg.run.seed, "data/quadratic"))
    task = QuadraticTask(centers, curvatures, p.sizes, p.noise, p.w0, p.dtype)
    if task.num_clients != cfg.clients.count:
        raise ValueError(f"data.centers has {task.num_clients} rows (clients) but clients.count = "
                         f"{cfg.clients.count}; they must match")
    return task


def _build_logreg(cfg: Any, p: LogRegParams) -> Task:
    return LogRegTask(p, int(cfg.clients.count), cfg.data.test_fraction, cfg.run.seed,
                      cfg.model.kind, tuple(cfg.model.hidden), cfg.model.init)


def _resolve(path: str, data_dir: str) -> Path:
    p = Path(path)
    if p.is_absolute():
        candidates = [p]
    else:
        candidates = [Path(data_dir) / p, p]
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError(f"data.path = {path!r}: no such file (looked at {', '.join(map(str, candidates))})")


def npz_file(cfg: Any, p: NpzParams) -> Path:
    """The .npz file of dataset = "npz": ValueError without data.path, FileNotFoundError naming the
    places looked at when it is not there (checked by `fedhop run` before any process starts)."""
    if not p.path:
        raise ValueError("data.path: dataset 'npz' needs the path of an .npz file (keys x_0, y_0, x_1, y_1, ...)")
    return _resolve(p.path, cfg.data.data_dir)


def _build_npz(cfg: Any, p: NpzParams) -> Task:
    data = datasets.load_npz(npz_file(cfg, p))
    n = len(data.xs)
    if n != cfg.clients.count:
        raise ValueError(f"{data.path} holds {n} clients (x_0..x_{n - 1}) but clients.count = "
                         f"{cfg.clients.count}; they must match")
    shapes = {x.shape[1:] for x in data.xs} | ({data.x_test.shape[1:]} if data.x_test is not None else set())
    if len(shapes) != 1:
        raise ValueError(f"{data.path}: every x_<i> (and x_test) needs the same feature shape, got {sorted(shapes)}")
    feature_shape = shapes.pop() or (1,)
    x_tr = np.concatenate([x.reshape(len(x), *feature_shape) for x in data.xs]).astype(np.float32)
    y_tr = np.concatenate(data.ys)
    x_te = None if data.x_test is None else data.x_test.reshape(len(data.x_test), *feature_shape).astype(np.float32)
    y_te = data.y_test
    offsets = np.cumsum([0] + [len(x) for x in data.xs])
    parts = [np.arange(offsets[i], offsets[i + 1], dtype=np.int64) for i in range(n)]
    if p.standardize:
        flat = [x_tr.reshape(len(x_tr), -1)] + ([x_te.reshape(len(x_te), -1)] if x_te is not None else [])
        scaled = standardize(*flat)
        x_tr = scaled[0].reshape(x_tr.shape)
        x_te = scaled[1].reshape(x_te.shape) if x_te is not None else None
    if p.task == "classification":
        labels = [y_tr] + ([y_te] if y_te is not None else [])
        for a in labels:
            if a.ndim != 1 or (a.dtype.kind not in "iub" and not (np.all(np.isfinite(a)) and np.all(a == np.round(a)))):
                raise ValueError(f"{data.path}: classification labels must be 1-D integers")
        top = max(int(a.max()) for a in labels if a.size)
        if top >= MAX_NPZ_CLASSES:
            raise ValueError(f"{data.path}: label {top} implies {top + 1} classes; at most {MAX_NPZ_CLASSES} "
                             f"classes (labels 0..{MAX_NPZ_CLASSES - 1})")
        y_tr = y_tr.astype(np.int64)
        y_te = None if y_te is None else y_te.astype(np.int64)
        n_classes = top + 1
        spec = model_spec(cfg, feature_shape, n_classes)
        return ClassificationTask(x_tr, y_tr, parts, spec, x_te, y_te, name="npz", n_classes=n_classes)
    y_tr = y_tr.astype(np.float32)
    y_te = None if y_te is None else y_te.astype(np.float32)
    n_out = 1 if y_tr.ndim == 1 else int(np.prod(y_tr.shape[1:]))
    if cfg.model.kind not in ("linear", "mlp"):
        raise ValueError(f"model.kind = {cfg.model.kind!r}: regression data allows linear, mlp")
    spec = model_spec(cfg, feature_shape, n_out, bias=p.bias)
    task = RegressionTask(x_tr, y_tr, parts, spec, x_te, y_te, name="npz", w_true=data.w_true)
    if data.w_true is not None:
        task.distance_to_opt(task.build_model())  # fails early on a w_true of the wrong size
    return task


def _arrays(data: Any, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) tensors from a pair of arrays or a map-style Dataset of (x, y) items."""
    if isinstance(data, (tuple, list)) and len(data) == 2:
        x, y = (torch.as_tensor(np.asarray(a)) if not isinstance(a, torch.Tensor) else a for a in data)
    elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        items = [data[i] for i in range(len(data))]
        if not items:
            raise ValueError(f"{where}: the Dataset is empty")
        x = torch.stack([torch.as_tensor(np.asarray(it[0])) for it in items])
        y = torch.as_tensor(np.asarray([np.asarray(it[1]) for it in items]))
    else:
        raise ValueError(f"{where}: expected a pair (x, y) or a torch Dataset of (x, y) items, got {type(data).__name__}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{where}: x has {x.shape[0]} samples but y has {y.shape[0]}")
    return x.float(), y


def _build_plugin(load: Callable[[DataRequest], Any]) -> Builder:
    """A data-set plug-in's builder: its per-client data becomes one pooled task, each client's
    samples its own index range (as for npz data)."""
    def build(cfg: Any, params: Any) -> Task:
        request = DataRequest(num_clients=int(cfg.clients.count), seed=stream_seed(cfg.run.seed, "data/plugin"),
                              params=params, data_dir=cfg.data.data_dir)
        name = cfg.data.dataset
        out = load(request)
        if isinstance(out, Task):
            return out
        if not isinstance(out, FederatedData):
            raise ValueError(f"data.dataset = {name!r} returned a {type(out).__name__}; expected FederatedData "
                             f"(fedhop.common.util.plugins) or a Task")
        if len(out.clients) != cfg.clients.count:
            raise ValueError(f"data.dataset = {name!r} returned {len(out.clients)} clients but clients.count = "
                             f"{cfg.clients.count}; they must match")
        pairs = [_arrays(c, f"{name}: client {i}") for i, c in enumerate(out.clients)]
        shapes = {tuple(x.shape[1:]) for x, _ in pairs}
        if len(shapes) != 1:
            raise ValueError(f"{name}: every client's samples need the same shape, got {sorted(shapes)}")
        x_tr = torch.cat([x for x, _ in pairs])
        y_tr = torch.cat([y for _, y in pairs])
        x_te, y_te = _arrays(out.test, f"{name}: test") if out.test is not None else (None, None)
        offsets = np.cumsum([0] + [len(x) for x, _ in pairs])
        parts = [np.arange(offsets[i], offsets[i + 1], dtype=np.int64) for i in range(len(pairs))]
        feature_shape = shapes.pop() or (1,)
        if out.task == "regression":
            n_out = 1 if y_tr.ndim == 1 else int(np.prod(y_tr.shape[1:]))
            return RegressionTask(x_tr, y_tr.float(), parts, model_spec(cfg, feature_shape, n_out), x_te,
                                  None if y_te is None else y_te.float(), name=name)
        labels = [y_tr] + ([y_te] if y_te is not None else [])
        n_classes = out.n_classes or int(max(int(t.max()) for t in labels if t.numel())) + 1
        return ClassificationTask(x_tr, y_tr.long(), parts, model_spec(cfg, feature_shape, n_classes), x_te,
                                  None if y_te is None else y_te.long(), name=name, n_classes=n_classes)
    return build


#: the data sets defined in this module (data.dataset -> (builder, its [data] keys)); the others: the
#: `REGISTER` of common/tasks/<module>.py
REGISTER = {"digits": (_build_tabular(datasets.load_digits, "digits", (8, 8)), None),
            "breast_cancer": (_build_tabular(datasets.load_breast_cancer, "breast_cancer", None), None),
            "mnist": (_build_mnist, None), "quadratic": (_build_quadratic, QuadraticParams),
            "logreg": (_build_logreg, LogRegParams), "npz": (_build_npz, NpzParams)}


def build_task(cfg: Any) -> Task:
    """The task for `cfg` (a `common.config_schema.Config`); same config -> same task."""
    entry = DATASETS.get(cfg.data.dataset)
    return with_model_selection(entry.build(cfg, dataset_params(cfg)), cfg.model)   # model.freeze / model.exchange
