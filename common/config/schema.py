"""The experiment config as typed dataclasses (DESIGN.md section 7).

`common.config.load_config` turns a TOML file into a `Config`, rejecting unknown keys, wrong
types and out-of-range values with an error that names the key, the value and what is
allowed.  Field metadata carries the validation rules and the key's description:

- `choices`: the allowed values of a string field;
- `min` / `max`: inclusive numeric bounds (`min_exclusive` / `max_exclusive` for strict ones);
- `file_name`: a string that must be one folder name (validate.py `file_name_problem`);
- `path`: a string naming a file or folder, which must not hold a NUL character;
- `host`: a string that must be a host name or an IP address (validate.py `host_problem`);
- `help`: one line for the config reference (docs/config.md, `fedhop config show`;
  deploy/cli/configref.py generates both from these dataclasses).

Sections whose keys depend on a choice (an algorithm's hyper-parameters, a data set's
parameters) keep the extra keys in `options`; the chosen algorithm or data set validates them
against its own `Params` dataclass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config key has a bad value, or does not exist."""


#: run.workers' default: the in-process engine's workers chosen by how the run can start them
WORKERS_AUTO = "auto"


def _f(default: Any = None, *, factory: Any = None, help: str = "", **rules: Any) -> Any:
    """A config field: its default, its description and its validation rules (module docstring)."""
    metadata = {**rules, "help": help} if help else rules
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class RunConfig:
    """The run as a whole: its name, seed, length, evaluation and checkpoints."""

    name: str = _f("fedhop-run", file_name=True, help="the run's name: the default run folder is "
                   "runs/NAME-seedS-TIMESTAMP, and reports label the run with it; one folder name (no '/', not "
                   "empty)")
    seed: int = _f(0, min=0, max=(1 << 63) - 1, help="the one seed every random draw derives from (data, partition, model, sampling); "
                                  "the same seed and config give the same model bit for bit")
    rounds: int = _f(10, min=1, help="server rounds")
    eval_every: int = _f(1, min=0, help="evaluate the model on the test set every this many rounds; 0 = only at "
                                        "the end")
    checkpoint_every: int = _f(0, min=0, help="write a checkpoint every this many rounds (fedhop run --resume "
                                              "continues from the newest); 0 = off")
    round_timeout: float = _f(120.0, min_exclusive=0.0, help="seconds the server waits for a round's results")
    call_timeout: float = _f(60.0, min_exclusive=0.0, help="seconds: the deadline of one RPC (a batch of several "
                                                           "clients' requests, transport.batch, runs under "
                                                           "run.round_timeout)")
    min_results: int | float = _f(1, min=0, help=(
        "a round counts when at least this many sampled clients' results arrived (else run.on_short_round): an int is a "
        "count (at most clients.per_round; 0 and 1 both mean one result); a float in (0, 1] a fraction of the "
        "clients sampled, rounded up. Default 1: a round goes on with whatever arrived"))
    on_short_round: str = _f("retry", choices=("retry", "skip", "fail"), help=(
        "a round with fewer results than run.min_results (its clients' processes died or did not answer): retry "
        "(sample it again among the live clients, at most 3 more times, then skip it), skip (leave the model as "
        "it is and go on to the next round), or fail (the run fails); retried and skipped rounds are run.db "
        "events. Retry and skip still fail the run once fewer clients than run.min_results are on processes not "
        "marked dead, or 10 rounds in a row are skipped; a round short through refused replies (NaN/Inf, a client's "
        "error) rather than lost processes fails as with fail"))
    log_level: str = _f("info", choices=("debug", "info", "warning", "error"),
                        help="log level of every process (their logs are in the run folder)")
    torch_threads: int = _f(1, min=1, max=1024, help="intra-op threads per process (1 keeps runs bit-reproducible)")
    device: str = _f("cpu", help="where the server aggregates, steps and evaluates: cpu, cuda, cuda:N, or auto "
                                 "(CUDA when this machine has it, else cpu); docs/gpus.md")
    engine: str = _f("processes", choices=("processes", "inprocess"), help=(
        "how `fedhop run` plays the run: processes (the server, edges and client processes as separate OS processes "
        "talking gRPC on loopback) or inprocess (every role in the one `fedhop run` process over in-memory endpoints "
        "that count each message's bytes as transport.kind would frame them, the clients training in worker "
        "processes as run.workers says: the same model bit for bit, the same run folder; no heartbeats, no sockets, "
        "no TLS; docs/run-folder.md). `fedhop run --engine` sets it"))
    workers: int | str = _f(WORKERS_AUTO, min=0, help=(
        "the in-process engine's client processes train in this many worker OS processes (0: one per CPU core it may "
        "use; at most one per client process); 1: in the `fedhop run` process itself; \"auto\" (the default): one "
        "per core the run may use (those its CPU affinity allows, or FEDHOP_RUN_CORES, which `fedhop sweep` sets to "
        "its runs' share) where `fedhop run` forks them (a CPU run), else 1, since a worker that is a fresh "
        "interpreter (the Python API, FEDHOP_START=exec, a GPU run) takes a second or more to start. A forked worker "
        "shares the run's data where run.torch_threads = 1 (docs/run-folder.md). The server and edges stay in the "
        "run's process and every message is still encoded, counted and recorded as with 1: the same run folder and "
        "the same model bit for bit. Topologies whose clients call each other (chain, gossip) keep them in the run's "
        "process; ignored by run.engine = processes"))


@dataclass
class TopologyConfig:
    """Who talks to whom: a star, edge servers between the server and the clients, or a walk."""

    kind: str = _f("star", help="star (clients under the server), hierarchical (edge servers in between), "
                                "sequential (one model passed between edges), chain (one model walks the clients), "
                                "relay (a walk through the server), gossip (clients average with their graph "
                                "neighbours, D-PSGD), or a plug-in (common/util/plugins.py)")
    edges: int = _f(0, min=0, help="number of edge servers (hierarchical and sequential need at least 1, at most "
                                   "clients.count)")
    assignment: str | list = _f("blocks", help="which clients each edge serves: \"blocks\" (consecutive ids), "
                                              "\"shuffled\" (a seeded shuffle), or explicit [[client ids], ...] "
                                              "per edge, each client exactly once")
    options: dict = _f(factory=dict)           # topology-specific keys (kappa2, graph, steps_per_round, ...)


@dataclass
class AlgorithmConfig:
    """The federated algorithm and the local training every algorithm shares."""

    name: str = _f("fedavg", help="the algorithm (its own keys are listed under its name below), or a plug-in "
                                  "\"package.module:Class\"")
    lr: float = _f(0.05, min=0.0, help="client (local) learning rate")
    server_lr: float = _f(1.0, min=0.0, help="server learning rate: the step applied to the aggregated update "
                                             "(1 = plain averaging)")
    local_steps: int | list = _f(0, help="local SGD steps per round: an int, or one entry per client; 0 = use "
                                         "local_epochs")
    local_epochs: int = _f(1, min=0, help="local epochs per round over the client's data (when local_steps = 0)")
    batch_size: int = _f(32, min=0, help="local minibatch size; 0 = full batch")
    lr_schedule: str = _f("constant", choices=("constant", "inv_sqrt"),
                          help="client step size over time: constant, or inv_sqrt (lr / sqrt(step + 1), where "
                               "the algorithm supports it)")
    regularizer: str = _f("none", choices=("none", "l1", "nuclear"),
                          help="composite term R(w) of the composite algorithms (fedmid, fedda, *_fedda): none, "
                               "l1 norm, or nuclear norm; another built-in algorithm refuses l1 and nuclear")
    reg: float = _f(0.0, min=0.0, help="lambda, the weight of the regularizer R(w) (0 for an algorithm without one)")
    weighting: str = _f("samples", choices=("samples", "uniform"),
                        help="aggregation weights: a client's number of samples, or uniform (1 per client)")
    weight_decay: float = _f(0.0, min=0.0, help="L2 weight decay in the clients' local SGD")
    vectorized: bool = _f(False, help="train the clients of one call (a batch, a worker's share, the round "
                                      "engine's loop) together: one torch.func.vmap step for all of them "
                                      "(docs/vectorized.md). Same algorithm and minibatches; rounding differs from "
                                      "one-at-a-time training, never with the engine or the batching. Every built-in "
                                      "algorithm, and a plug-in written as SolverAlgorithm.local_solver; a task whose "
                                      "loss is a mean of per-example losses and a pure function, a model without "
                                      "buffers exchanged whole, no DP-SGD")
    vectorized_memory_mb: int = _f(512, min=1, help="under vectorized: the most memory (MB) one stack of clients "
                                                    "trained together may take, estimated from the model's size and "
                                                    "the activations one example keeps for the backward pass; a call's "
                                                    "clients are trained in as many stacks as that needs (the same "
                                                    "results: a client's does not depend on its stack)")
    compress: str = _f("none", choices=("none", "qsgd"), help="upload compressor (common/processors/compress.py)")
    qsgd_levels: int = _f(15, min=1, max=1 << 20, help="QSGD s (levels per sign)")
    qsgd_bucket: int = _f(0, min=0, help="QSGD bucket size B (a norm per B elements); 0 = whole tensor")
    options: dict = _f(factory=dict)           # algorithm-specific hyper-parameters


@dataclass
class DataConfig:
    """The data set, how it is split between clients, and where its files are."""

    dataset: str = _f("digits", help="the data set (its own keys are listed under its name below), or a plug-in: "
                                     "an import path \"package.module:function\" or a fedhop.datasets entry point")
    partition: str = _f("dirichlet", choices=("iid", "dirichlet", "shards", "natural", "lognormal", "pareto"),
                        help="how samples are split between clients: iid, dirichlet (label skew, alpha), shards "
                             "(shards_per_client classes each), natural (one client per writer/speaker/user: "
                             "femnist, sent140, shakespeare), or lognormal / pareto (quantity skew: skew_sigma / skew_shape)")
    alpha: float = _f(0.5, min_exclusive=0.0, help="Dirichlet concentration of partition = \"dirichlet\" (smaller "
                                                   "= more skewed)")
    min_size: int = _f(2, min=0, help="Dirichlet: resample until every client has this many samples")
    shards_per_client: int = _f(2, min=1, help="shards: classes per client")
    skew_sigma: float = _f(1.0, min_exclusive=0.0, help="partition = \"lognormal\": sigma of the clients' "
                                                        "LogNormal(0, sigma) size weights")
    skew_shape: float = _f(1.5, min_exclusive=0.0, help="partition = \"pareto\": tail index of the clients' "
                                                         "1 + Lomax(shape) size weights (smaller = heavier)")
    test_fraction: float = _f(0.25, min_exclusive=0.0, max=0.9, help="share of the data held out as the test set")
    data_dir: str = _f("data", path=True, help="where pre-staged files (MNIST / Fashion-MNIST IDX, CIFAR binary batches, LEAF JSON, npz) are looked up: docs/datasets.md")
    standardize: bool = _f(True, help="scale features to zero mean and unit variance (statistics of the training "
                                      "split)")
    options: dict = _f(factory=dict)           # data-set-specific keys (centers, curvatures, sizes, ...)


@dataclass
class ModelConfig:
    """The model every party trains (data sets with a fixed model, such as quadratic, ignore it)."""

    kind: str = _f("mlp", choices=("linear", "logreg", "mlp", "cnn", "mcmahan_cnn", "leaf_cnn", "cifar_cnn",
                                   "resnet18_gn", "char_lstm"),
                   help="the built-in model: linear (regression), logreg (softmax regression), mlp, cnn (small "
                        "LeNet), mcmahan_cnn / leaf_cnn (the 2-conv CNN of McMahan et al. with a 512 / 2048 FC "
                        "layer), cifar_cnn, resnet18_gn (ResNet-18 with GroupNorm), char_lstm (Shakespeare); "
                        "docs/datasets.md")
    init: str = _f("default", choices=("default", "zeros"),
                   help="initial weights: torch's default (seeded), or all zeros")
    hidden: list = _f(factory=lambda: [64], help="MLP hidden layer widths")
    factory: str = _f("", help="a user's model: \"pkg.module:make_net\" or a fedhop.models entry point")
    factory_args: dict = _f(factory=dict, help="keyword arguments of the factory")
    freeze: list[str] = _f(factory=list, help="glob patterns on parameter names (\"conv1.*\", \"layers.0.*\") whose "
                                              "parameters are frozen: the local solvers leave them as built "
                                              "(seeded init, factory); a pattern that matches nothing is an error")
    exchange: str = _f("all", help="which parameters travel and are aggregated: all (every one, frozen ones too), "
                                   "trainable (those not frozen), or \"pkg.module:select\" (a plug-in "
                                   "select(name, parameter) -> bool; the rest is frozen); checkpoints and "
                                   "model.safetensors hold the whole model; docs/architecture.md")


@dataclass
class ClientsConfig:
    """How many clients, how many take part each round, and the processes that host them."""

    count: int = _f(10, min=1, help="number of clients")
    per_round: int | float = _f(1.0, min=0, help="clients sampled per round: an int is a number; a float in "
                                                 "(0, 1] a fraction (default: all)")
    processes: int = _f(2, min=1, help="client OS processes; the clients are spread over them")
    device: str = _f("cpu", help="where the client processes train: cpu, cuda (spread over clients.gpus, or over "
                                 "every visible GPU), cuda:N, or auto (CUDA when present, else cpu); docs/gpus.md")
    gpus: list = _f(factory=list, help="GPU indices (as CUDA_VISIBLE_DEVICES numbers them) the client processes are "
                                       "spread over round-robin; empty = every visible GPU")
    processes_per_gpu: int = _f(0, min=0, help="at most this many client processes per GPU (a run that needs more "
                                               "is refused before it starts); 0 = no limit")
    straggler_fraction: float = _f(0.0, min=0.0, max=1.0,
                                   help="rho: the fraction of each round's sampled clients that do only part of "
                                        "their local work (docs/heterogeneity.md)")
    options: dict = _f(factory=dict)


@dataclass
class EdgesConfig:
    """The edge server processes (topology.edges of them, in the hierarchical and sequential topologies)."""

    device: str = _f("cpu", help="where the edges aggregate and step: cpu, cuda, cuda:N, or auto (CUDA when "
                                 "present, else cpu); docs/gpus.md")


@dataclass
class TransportConfig:
    """How messages move between processes."""

    kind: str = _f("grpc",   # the transport registry (common/transport/factory.py): a folder, or a plug-in
                   help="grpc (processes over sockets), torch (torch.distributed collectives, "
                        "docs/torch_transport.md), inmemory (one process, for tests), or a plug-in transport "
                        "'package.module:TRANSPORT' (docs/plugins.md)")
    chunk_bytes: int = _f(4 * 1024 * 1024, min=1024, help="largest frame of a message: bigger messages are "
                                                           "streamed in chunks of this many bytes")
    max_message_bytes: int = _f(64 * 1024 * 1024, min=1024, help="gRPC max send/receive, both sides")
    window_bytes: int = _f(16 * 1024 * 1024, min=65536, help="HTTP/2 flow-control window of every gRPC stream, "
                                                              "fixed (no BDP probing): the most a peer can send on a "
                                                              "stream this process has not read yet; one stream moves "
                                                              "at most window / round-trip time (16 MiB: 1.3 Gbit/s at "
                                                              "100 ms), so raise it on a long fat link")
    host: str = _f("127.0.0.1", host=True, help="the address the server and edges listen on (off loopback needs TLS or "
                                     "security.insecure = true)")
    batch: bool = _f(True, help="requests to the logical clients of one process share gRPC calls, at most one "
                                "chunk of requests each (each still its own message with its own ledger records, "
                                "the same model bit for bit; common/transport/grpc.py, Batches): per-call costs "
                                "paid once per process and round.  A request or reply that may exceed a chunk "
                                "still goes alone.  A batch runs under run.round_timeout, not run.call_timeout; "
                                "false: one call per client (framed bytes 5 more per message after a batch's "
                                "first, docs/crossdevice.md)")
    reply_bundle: int = _f(16, min=1, help="replies of one batched call that travel in one gRPC message (each reply "
                                           "still its own message in the ledger, framed bytes its share of the "
                                           "bundle; common/transport/grpc.py, Batches): fewer sends for many small "
                                           "replies, but a reply waits for the others of its bundle, so a round "
                                           "deadline may cut up to reply_bundle - 1 computed replies of a late "
                                           "process; 1: each reply sent the moment it is computed")
    wire_compression: str = _f("none", choices=("none", "gzip", "deflate"),
                               help="gRPC's own compression of every call's messages, both directions (grpc "
                                    "transport only; docs/compression.md): the ledger still counts the "
                                    "framed bytes before it, so measure what it saves with "
                                    "benchmarks/wire_compression.py")
    options: dict = _f(factory=dict)


@dataclass
class SecurityConfig:
    """Channels, node credentials, liveness and input policy (docs/faults.md, common/security/auth.py)."""

    insecure: bool = _f(False, help="plaintext gRPC off loopback needs this set explicitly")
    certs_dir: str = _f("", path=True, help="TLS: a directory made by `fedhop certs` (ca.pem, NODE.pem, NODE.key)")
    mtls: bool = _f(False, help="mutual TLS: the node identity is its certificate's common name")
    checksum: bool = _f(True, help="XXH3-64 of every message's tensor bytes, verified by the receiver; a message without one is refused (CHECKSUM_MISSING)")
    heartbeat_interval: float = _f(1.0, min_exclusive=0.0, help="seconds between a child's heartbeats")
    heartbeat_timeout: float = _f(5.0, min_exclusive=0.0, help="silence after which a parent marks a child dead "
                                                              "(seconds; more than heartbeat_interval)")
    parent_timeout: float = _f(60.0, min_exclusive=0.0, help="a child gives up (exits) after this long unheard "
                                                            "(seconds)")
    backoff_base: float = _f(0.2, min_exclusive=0.0, help="re-registration: full-jitter exponential backoff, "
                                                         "first delay (seconds)")
    backoff_cap: float = _f(5.0, min_exclusive=0.0, help="re-registration: the longest backoff delay (seconds; at "
                                                        "least backoff_base)")
    nan_policy: str = _f("reject", choices=("reject", "fail"),
                         help="NaN/Inf in a result: drop it, or fail the run")
    keep_checkpoints: int = _f(2, min=1, help="newest checkpoints kept in RUN_DIR/checkpoints")
    aggregation: str = _f("mean", choices=("mean", "median", "trimmed_mean", "krum", "multi_krum",
                                            "majority_vote"),
                          help="the server's (and edges') reduction of updates: the weighted mean, a "
                               "Byzantine-robust rule, or signSGD's majority vote sign(sum_i sign(update_i)) "
                               "(common/engine/robust.py)")
    trim: float = _f(0.1, min=0.0, max=0.49, help="trimmed_mean: fraction dropped at each end per coordinate")
    krum_f: int = _f(1, min=0, help="krum, multi_krum: the number of Byzantine updates tolerated (each group needs "
                                    "n > 2f + 2 updates)")
    krum_m: int = _f(0, min=0, help="multi_krum: the number of lowest-scoring updates averaged, at most n - f; 0 = "
                                    "n - f of each group")


@dataclass
class CompressionConfig:
    """What uploads carry instead of their float tensors: a client's reply to a train call and an
    edge's partial aggregate (common/processors/compressors/, docs/compression.md).  The chosen
    compressor's own keys follow in this section."""

    up: str = _f("none", help="the uploads' compressor: none, qsgd, topk, randk, threshold, sign, scaled_sign, "
                              "rounding, natural, fp16, bf16, powersgd, or a plug-in 'package.module:Class' (docs/compression.md)")
    edge: str = _f("same", choices=("same", "none"), help="an edge's partial aggregate: coded with compression.up "
                                                          "(same) or sent plain (none)")
    error_feedback: str = _f("none", choices=("none", "ef", "ef21"),
                             help="ef: EF-SGD, each sender codes its update plus the residual it kept, and keeps "
                                  "what the code lost; ef21: EF21, each sender codes the difference to its "
                                  "estimate g, which it and its parent both advance (every state checkpointed)")
    down: str = _f("none", help="the broadcasts (star and hierarchical topologies over gRPC or in memory; an "
                                "edge codes its own to its clients): none, same "
                                "(compression.up's compressor and keys), or a compressor whose keys are "
                                "compression.down_keys; each receiver gets a coded difference to the model it "
                                "holds, or the model itself when it holds none the server still has differences "
                                "for (docs/compression.md, Downlink)")
    down_keys: dict = _f(factory=dict, help="the keys of compression.down's compressor, e.g. {ratio = 0.05} "
                                            "(unset keys: the compressor's defaults)")
    min_numel: int = _f(2, min=1, help="float tensors with fewer elements travel plain")
    layers: dict = _f(factory=dict, help="per-tensor settings by name pattern (fnmatch; the first that matches "
                                         "decides): \"plain\" sends the tensor uncompressed, a table sets the "
                                         "compressor's keys for it, e.g. {\"*.bias\" = \"plain\", \"fc1.*\" = "
                                         "{ratio = 0.1}}")
    options: dict = _f(factory=dict)


@dataclass
class SecureAggregationConfig:
    """Secure aggregation, SecAgg+ (Bell et al. 2020; the complete graph is Bonawitz et al. 2017's
    SecAgg): each star round's sampled clients go through four phases (advertise keys, share keys,
    masked input, unmasking) and the server learns only the sum of their clipped, quantized
    updates; behind edges each edge runs them for its cluster (docs/secure-aggregation.md); with
    [privacy] the star's server noises that sum (docs/privacy.md)."""

    enabled: bool = _f(False, help="run every round's sampled clients through SecAgg+ instead of plain train calls "
                                   "(star topology, or hierarchical: each edge for its cluster; FedAvg-family "
                                   "algorithms with algorithm.weighting = \"uniform\")")
    degree: int = _f(0, min=0, help="neighbours per client in the round's Harary graph; 0 (or >= the clients per "
                                    "round - 1) = the complete graph, SecAgg")
    threshold: int = _f(0, min=0, help="t: shares that reconstruct a client's secret, with 2t > degree and t <= degree; "
                                       "0 = floor(degree / 2) + 1; a neighbourhood tolerates degree - t dropouts")
    modulus_bits: int = _f(32, min=1, max=64, help="R = 2^modulus_bits: the masked values' ring; at least "
                                                   "the code's bits (quant_bits, or compression.up's: rounding's "
                                                   "bits, ceil(log2(2 qsgd levels + 1)), 1 for sign) + "
                                                   "ceil(log2(clients per round))")
    clip: float = _f(1.0, min_exclusive=0.0, help="an update is clipped to this L2 norm before quantization")
    quant_bits: int = _f(16, min=1, max=62, help="a coordinate in [-clip, clip] becomes an integer in "
                                                 "[0, 2^quant_bits - 1] by stochastic rounding; compression.up = "
                                                 "rounding, qsgd or sign codes it instead "
                                                 "(docs/secure-aggregation.md, Compressors)")
    dropouts: list = _f(factory=list, help="tests and development only: injected dropouts, each "
                                           "\"ROUND:PHASE:CLIENT[:ACTION]\" (PHASE advertise, share, masked or unmask; "
                                           "ACTION refuse, the default: the client's call fails, or exit: its process "
                                           "ends); docs/secure-aggregation.md")


@dataclass
class PrivacyConfig:
    """Differential privacy of the clients' updates (common/privacy/, docs/privacy.md): each update
    clipped to an L2 bound C, Gaussian noise scaled to C, and epsilon at `delta` from
    dp-accounting after every round."""

    mode: str = _f("none", choices=("none", "central", "client", "local", "dpsgd"), help=(
        "none; central (DP-FedAvg, McMahan et al. 2018: the server (behind edges: each edge) clips each client's "
        "update to clip_norm and "
        "adds N(0, (noise_multiplier * C)^2) to their sum); client (each client clips its own update, the server "
        "adds the noise: a trusted aggregator); local (each client clips and adds the noise to its own update); "
        "dpsgd (sample-level DP-SGD inside each client, Abadi et al. 2016: each example's gradient clipped to "
        "clip_norm, noise on each step's sum)"))
    clipping: str = _f("fixed", choices=("fixed", "adaptive"), help=(
        "fixed (clip_norm throughout) or adaptive (Andrew et al. 2021: C follows the target_quantile of the "
        "update norms from a noisy count of the unclipped updates; central and client modes)"))
    clip_norm: float = _f(0.0, min=0.0, help="C, the L2 bound of one client's whole update (all tensors together); "
                                             "the initial C with adaptive clipping; needed by every mode")
    noise_multiplier: float = _f(0.0, min=0.0, max=1e6, help="z: the noise's standard deviation is z * C on the sum of "
                                                    "the clipped updates (local: on each update); 0 = clipping "
                                                    "only (epsilon infinite)")
    target_quantile: float = _f(0.5, min=0.0, max=1.0, help="adaptive clipping: gamma, the fraction of updates "
                                                            "meant to be within C")
    clip_lr: float = _f(0.2, min=0.0, help="adaptive clipping: eta_C of the geometric update C <- C exp(-eta_C "
                                           "(b_bar - gamma))")
    clipped_count_stddev: float = _f(0.0, min=0.0, help="adaptive clipping: sigma_b, the noise on the count of "
                                                        "unclipped updates; 0 = clients per round / 20 (the "
                                                        "paper's suggestion)")
    delta: float = _f(1e-5, min_exclusive=0.0, max_exclusive=1.0, help="the delta at which epsilon is reported")
    accountant: str = _f("rdp", choices=("rdp", "pld"), help="dp-accounting's RDP or PLD accountant")
    sampling: str = _f("poisson", choices=("poisson", "fixed_size"), help=(
        "the sampling event the accountant is charged each round: poisson (rate q = sampled / clients, "
        "add-or-remove adjacency, as McMahan et al.) or fixed_size (m of N without replacement, replace-one "
        "adjacency; rdp only)"))
    target_epsilon: float = _f(0.0, min=0.0, help="0 = none; else see on_target")
    on_target: str = _f("stop", choices=("stop", "calibrate"), help=(
        "with target_epsilon: stop (the run ends before a round would take epsilon past it) or calibrate "
        "(noise_multiplier is set before the run, with dp-accounting, so run.rounds rounds spend it)"))
    secure_noise: bool = _f(False, help="draw the noise from the operating system's cryptographically secure "
                                        "generator (os.urandom) instead of the run's seeded stream")
    noise_at: str = _f("server", choices=("server", "edges"), help=(
        "behind edges (topology.kind = 'hierarchical'), central and client modes: server (the server adds "
        "N(0, (z C)^2) to the sum of the edges' partial sums) or edges (each edge adds its share "
        "N(0, (z C)^2 n_e / m) to its cluster's sum, so the server never sees an un-noised sum; docs/privacy.md)"))


@dataclass
class ProcessorConfig:
    """A user's processor in the payload chains (common/processors/pipeline.py): one `[[processors]]` table each,
    in the order they run.  Its other keys are the processor's keyword options."""

    name: str = _f("", help="the processor (required): \"package.module:Class\" (a module beside the config works) "
                            "or a fedhop.processors entry point; called with the table's other keys as keyword "
                            "options, it gives an object with process(message, ctx)")
    methods: list[str] = _f(factory=list, help="the protocol methods whose messages it sees (common/wire/methods.py: "
                                               "train, edge_round, torch_reduce, gossip_share, walk_handoff, ...); "
                                               "empty = every method")
    direction: str = _f("in", choices=("in", "out"), help="in: messages received (after the built-in decoding and "
                                                          "validation); out: uploads about to be sent (before "
                                                          "compression)")
    roles: list[str] = _f(factory=lambda: ["server", "edge", "client"],
                          help="the processes that run it: server, edge, client; each must be able to load it (a "
                               "client or edge only loads plug-ins it was started with)")
    options: dict = _f(factory=dict)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    clients: ClientsConfig = field(default_factory=ClientsConfig)
    edges: EdgesConfig = field(default_factory=EdgesConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    secure_aggregation: SecureAggregationConfig = field(default_factory=SecureAggregationConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    processors: list[ProcessorConfig] = field(default_factory=list)   # [[processors]], in order


#: the TOML tables of a config, in the order `config_to_toml` writes them, and their dataclasses
SECTIONS: dict[str, type] = {"run": RunConfig, "topology": TopologyConfig, "algorithm": AlgorithmConfig,
                             "data": DataConfig, "model": ModelConfig, "clients": ClientsConfig,
                             "edges": EdgesConfig, "transport": TransportConfig, "security": SecurityConfig,
                             "compression": CompressionConfig, "secure_aggregation": SecureAggregationConfig,
                             "privacy": PrivacyConfig}


# ----------------------------------------------------------------------------- values derived from a config
def resolve_clients_per_round(cfg: Config) -> int:
    per = cfg.clients.per_round
    if isinstance(per, float):
        return max(1, math.ceil(per * cfg.clients.count))
    return int(per)


def resolve_min_results(cfg: Config, sampled: int) -> int:
    mr = cfg.run.min_results
    if isinstance(mr, float):
        return max(1, math.ceil(mr * sampled))
    return min(int(mr), sampled)


def client_local_steps(cfg: Config, client_id: int) -> int:
    steps = cfg.algorithm.local_steps
    return int(steps[client_id]) if isinstance(steps, list) else int(steps)
