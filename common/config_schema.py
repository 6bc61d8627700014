"""The experiment config as typed dataclasses (DESIGN.md section 7).

`common.config.load_config` turns a TOML file into a `Config`, rejecting unknown keys, wrong
types and out-of-range values with an error that names the key, the value and what is
allowed.  Field metadata carries the validation rules:

- `choices`: the allowed values of a string field;
- `min` / `max`: inclusive numeric bounds (`min_exclusive` for strict lower bounds).

Sections whose keys depend on a choice (an algorithm's hyper-parameters, a data set's
parameters) keep the extra keys in `options`; the chosen algorithm or data set validates them
against its own `Params` dataclass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _f(default: Any = None, *, factory: Any = None, **rules: Any) -> Any:
    if factory is not None:
        return field(default_factory=factory, metadata=rules)
    return field(default=default, metadata=rules)


@dataclass
class RunConfig:
    name: str = "fedhop-run"
    seed: int = _f(0, min=0)
    rounds: int = _f(10, min=1)
    eval_every: int = _f(1, min=0)            # 0 = evaluate only at the end
    checkpoint_every: int = _f(0, min=0)      # 0 = off
    round_timeout: float = _f(120.0, min_exclusive=0.0)   # seconds the server waits for a round's results
    call_timeout: float = _f(60.0, min_exclusive=0.0)     # deadline of one RPC
    # a round counts when at least this many sampled clients' results arrived, else the run fails:
    # int: a count (at most clients.per_round; 0 and 1 both mean one result); float in (0, 1]: a
    # fraction of the clients sampled, rounded up.  Default 1: a round goes on with whatever arrived
    min_results: int | float = _f(1, min=0)
    log_level: str = _f("info", choices=("debug", "info", "warning", "error"))
    torch_threads: int = _f(1, min=1)         # intra-op threads per process (1 keeps runs bit-reproducible)


@dataclass
class TopologyConfig:
    kind: str = "star"   # star, hierarchical, sequential, chain, relay, or a plug-in (common/plugins.py), checked on load
    edges: int = _f(0, min=0)
    assignment: str | list = "blocks"          # "blocks" or explicit [[client ids], ...] per edge
    options: dict = _f(factory=dict)           # topology-specific keys (kappa1, graph, steps_per_round, ...)


@dataclass
class AlgorithmConfig:
    name: str = "fedavg"
    lr: float = _f(0.05, min=0.0)
    server_lr: float = _f(1.0, min=0.0)
    local_steps: int | list = 0                # int, or one entry per client; 0 = use local_epochs
    local_epochs: int = _f(1, min=0)
    batch_size: int = _f(32, min=0)            # 0 = full batch
    lr_schedule: str = _f("constant", choices=("constant", "inv_sqrt"))
    regularizer: str = _f("none", choices=("none", "l1", "nuclear"))
    reg: float = _f(0.0, min=0.0)
    weighting: str = _f("samples", choices=("samples", "uniform"))
    weight_decay: float = _f(0.0, min=0.0)
    compress: str = _f("none", choices=("none", "qsgd"))   # upload compressor (common/compress.py)
    qsgd_levels: int = _f(15, min=1, max=1 << 20)          # QSGD s (levels per sign)
    qsgd_bucket: int = _f(0, min=0)                        # QSGD bucket size B (a norm per B elements); 0 = whole tensor
    options: dict = _f(factory=dict)           # algorithm-specific hyper-parameters


@dataclass
class DataConfig:
    # built in: digits, breast_cancer, mnist, quadratic, logreg, lasso, lowrank, minimax_quadratic, npz,
    # robust_digits, fair_digits; or a user's plug-in (an import path or a fedhop.datasets entry point)
    dataset: str = "digits"
    partition: str = _f("dirichlet", choices=("iid", "dirichlet", "shards"))
    alpha: float = _f(0.5, min_exclusive=0.0)
    min_size: int = _f(2, min=0)               # Dirichlet: resample until every client has this many
    shards_per_client: int = _f(2, min=1)      # shards: classes per client
    test_fraction: float = _f(0.25, min_exclusive=0.0, max=0.9)
    data_dir: str = "data"                     # where pre-staged files (MNIST IDX, npz) are looked up
    standardize: bool = True
    options: dict = _f(factory=dict)           # data-set-specific keys (centers, curvatures, sizes, ...)


@dataclass
class ModelConfig:
    kind: str = _f("mlp", choices=("linear", "logreg", "mlp", "cnn"))
    init: str = _f("default", choices=("default", "zeros"))
    hidden: list = _f(factory=lambda: [64])   # MLP hidden widths
    factory: str = ""                          # a user's model: "pkg.module:make_net" or a fedhop.models entry point
    factory_args: dict = _f(factory=dict)     # keyword arguments of the factory


@dataclass
class ClientsConfig:
    count: int = _f(10, min=1)
    per_round: int | float = _f(1.0, min=0)   # int: number sampled; float in (0, 1]: fraction (default: all)
    processes: int = _f(2, min=1)
    straggler_fraction: float = _f(0.0, min=0.0, max=1.0)
    options: dict = _f(factory=dict)


@dataclass
class TransportConfig:
    kind: str = _f("grpc", choices=("grpc", "torch", "inmemory"))
    chunk_bytes: int = _f(4 * 1024 * 1024, min=1024)
    max_message_bytes: int = _f(64 * 1024 * 1024, min=1024)   # gRPC max send/receive, both sides
    host: str = "127.0.0.1"
    # requests to the logical clients of one process share gRPC calls (each still its own message
    # with its own ledger records; common/transport/grpc.py, Batches): cross-device scale
    batch: bool = False
    options: dict = _f(factory=dict)


@dataclass
class SecurityConfig:
    """Channels, node credentials, liveness and input policy (docs/faults.md, common/security.py)."""

    insecure: bool = False                     # plaintext gRPC off loopback needs this set explicitly
    certs_dir: str = ""                        # TLS: a directory made by `fedhop certs` (ca.pem, NODE.pem, NODE.key)
    mtls: bool = False                         # mutual TLS: the node identity is its certificate's common name
    checksum: bool = True                      # XXH3-64 of every message's tensor bytes, verified by the receiver
    heartbeat_interval: float = _f(1.0, min_exclusive=0.0)   # seconds between a child's heartbeats
    heartbeat_timeout: float = _f(5.0, min_exclusive=0.0)    # silence after which a parent marks a child dead
    parent_timeout: float = _f(60.0, min_exclusive=0.0)      # a child gives up (exits) after this long unheard
    backoff_base: float = _f(0.2, min_exclusive=0.0)         # re-registration: full-jitter exponential backoff
    backoff_cap: float = _f(5.0, min_exclusive=0.0)
    nan_policy: str = _f("reject", choices=("reject", "fail"))   # NaN/Inf in a result: drop it, or fail the run
    keep_checkpoints: int = _f(2, min=1)       # newest checkpoints kept in RUN_DIR/checkpoints
    aggregation: str = _f("mean", choices=("mean", "median", "trimmed_mean", "krum"))   # common/robust.py
    trim: float = _f(0.1, min=0.0, max=0.49)   # trimmed_mean: fraction dropped at each end per coordinate
    krum_f: int = _f(1, min=0)                 # krum: the number of Byzantine updates tolerated


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    clients: ClientsConfig = field(default_factory=ClientsConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
