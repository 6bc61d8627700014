from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Scalar(_message.Message):
    __slots__ = ("f", "i", "b", "s")
    F_FIELD_NUMBER: _ClassVar[int]
    I_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    S_FIELD_NUMBER: _ClassVar[int]
    f: float
    i: int
    b: bool
    s: str
    def __init__(self, f: _Optional[float] = ..., i: _Optional[int] = ..., b: _Optional[bool] = ..., s: _Optional[str] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("run_id", "round", "step", "src", "dst", "method", "msg_id", "tensors", "scalars", "data_bytes", "error", "token", "checksum", "control")
    class ScalarsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Scalar
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Scalar, _Mapping]] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MSG_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SCALARS_FIELD_NUMBER: _ClassVar[int]
    DATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    step: int
    src: str
    dst: str
    method: str
    msg_id: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    scalars: _containers.MessageMap[str, Scalar]
    data_bytes: int
    error: Error
    token: str
    checksum: bool
    control: Control
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., step: _Optional[int] = ..., src: _Optional[str] = ..., dst: _Optional[str] = ..., method: _Optional[str] = ..., msg_id: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., scalars: _Optional[_Mapping[str, Scalar]] = ..., data_bytes: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., token: _Optional[str] = ..., checksum: _Optional[bool] = ..., control: _Optional[_Union[Control, _Mapping]] = ...) -> None: ...

class EnvelopeSpecs(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, tensors: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Control(_message.Message):
    __slots__ = ("clients", "failures", "layout", "specs", "peers", "skipped", "neighbours", "processes", "world", "walk_peers")
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SPECS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    WALK_PEERS_FIELD_NUMBER: _ClassVar[int]
    clients: _containers.RepeatedScalarFieldContainer[int]
    failures: _containers.RepeatedCompositeFieldContainer[ClientFailure]
    layout: _containers.RepeatedCompositeFieldContainer[ReduceEntry]
    specs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    peers: _containers.RepeatedCompositeFieldContainer[EdgeAddress]
    skipped: _containers.RepeatedCompositeFieldContainer[SkippedEdge]
    neighbours: _containers.RepeatedCompositeFieldContainer[NeighbourAnswer]
    processes: _containers.RepeatedScalarFieldContainer[str]
    world: TorchWorld
    walk_peers: _containers.RepeatedCompositeFieldContainer[ClientAddress]
    def __init__(self, clients: _Optional[_Iterable[int]] = ..., failures: _Optional[_Iterable[_Union[ClientFailure, _Mapping]]] = ..., layout: _Optional[_Iterable[_Union[ReduceEntry, _Mapping]]] = ..., specs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., peers: _Optional[_Iterable[_Union[EdgeAddress, _Mapping]]] = ..., skipped: _Optional[_Iterable[_Union[SkippedEdge, _Mapping]]] = ..., neighbours: _Optional[_Iterable[_Union[NeighbourAnswer, _Mapping]]] = ..., processes: _Optional[_Iterable[str]] = ..., world: _Optional[_Union[TorchWorld, _Mapping]] = ..., walk_peers: _Optional[_Iterable[_Union[ClientAddress, _Mapping]]] = ...) -> None: ...

class ClientAddress(_message.Message):
    __slots__ = ("client_id", "address")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    address: str
    def __init__(self, client_id: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class ClientFailure(_message.Message):
    __slots__ = ("client_id", "reason")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    reason: str
    def __init__(self, client_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ReduceEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape", "op")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    op: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., op: _Optional[str] = ...) -> None: ...

class EdgeAddress(_message.Message):
    __slots__ = ("edge", "address")
    EDGE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    edge: int
    address: str
    def __init__(self, edge: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class SkippedEdge(_message.Message):
    __slots__ = ("edge", "reason")
    EDGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    edge: int
    reason: str
    def __init__(self, edge: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class NeighbourAnswer(_message.Message):
    __slots__ = ("edge", "visits", "data_size")
    EDGE_FIELD_NUMBER: _ClassVar[int]
    VISITS_FIELD_NUMBER: _ClassVar[int]
    DATA_SIZE_FIELD_NUMBER: _ClassVar[int]
    edge: int
    visits: int
    data_size: int
    def __init__(self, edge: _Optional[int] = ..., visits: _Optional[int] = ..., data_size: _Optional[int] = ...) -> None: ...

class TorchWorld(_message.Message):
    __slots__ = ("ranks", "groups", "clusters", "group")
    class RanksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ClustersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RANKS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.ScalarMap[str, int]
    groups: _containers.RepeatedCompositeFieldContainer[RankGroup]
    clusters: _containers.ScalarMap[str, int]
    group: int
    def __init__(self, ranks: _Optional[_Mapping[str, int]] = ..., groups: _Optional[_Iterable[_Union[RankGroup, _Mapping]]] = ..., clusters: _Optional[_Mapping[str, int]] = ..., group: _Optional[int] = ...) -> None: ...

class RankGroup(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("header", "data", "data_xxh3")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DATA_XXH3_FIELD_NUMBER: _ClassVar[int]
    header: Envelope
    data: bytes
    data_xxh3: int
    def __init__(self, header: _Optional[_Union[Envelope, _Mapping]] = ..., data: _Optional[bytes] = ..., data_xxh3: _Optional[int] = ...) -> None: ...

class FrameBundle(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, frames: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LogicalClient(_message.Message):
    __slots__ = ("client_id", "num_samples")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    num_samples: int
    def __init__(self, client_id: _Optional[int] = ..., num_samples: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("node_id", "role", "address", "clients", "token", "run_id", "msg_id", "refusal", "proof_key")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MSG_ID_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    PROOF_KEY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    address: str
    clients: _containers.RepeatedCompositeFieldContainer[LogicalClient]
    token: str
    run_id: str
    msg_id: str
    refusal: str
    proof_key: bytes
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., clients: _Optional[_Iterable[_Union[LogicalClient, _Mapping]]] = ..., token: _Optional[str] = ..., run_id: _Optional[str] = ..., msg_id: _Optional[str] = ..., refusal: _Optional[str] = ..., proof_key: _Optional[bytes] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("target", "nonce", "key_id", "run_id", "parent")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    target: str
    nonce: bytes
    key_id: bytes
    run_id: str
    parent: str
    def __init__(self, target: _Optional[str] = ..., nonce: _Optional[bytes] = ..., key_id: _Optional[bytes] = ..., run_id: _Optional[str] = ..., parent: _Optional[str] = ...) -> None: ...

class ProbeReply(_message.Message):
    __slots__ = ("node_id", "proof")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    proof: bytes
    def __init__(self, node_id: _Optional[str] = ..., proof: _Optional[bytes] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("accepted", "run_id", "config_toml", "message", "node_id")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_TOML_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    run_id: str
    config_toml: str
    message: str
    node_id: str
    def __init__(self, accepted: _Optional[bool] = ..., run_id: _Optional[str] = ..., config_toml: _Optional[str] = ..., message: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class LinkBytes(_message.Message):
    __slots__ = ("node_id", "link", "direction", "messages", "tensor_bytes", "payload_bytes", "framed_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAMED_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    link: str
    direction: str
    messages: int
    tensor_bytes: int
    payload_bytes: int
    framed_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., link: _Optional[str] = ..., direction: _Optional[str] = ..., messages: _Optional[int] = ..., tensor_bytes: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., framed_bytes: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "run_id", "seq", "sent_at", "bytes", "events")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    run_id: str
    seq: int
    sent_at: float
    bytes: _containers.RepeatedCompositeFieldContainer[LinkBytes]
    events: _containers.RepeatedCompositeFieldContainer[NodeEvent]
    def __init__(self, node_id: _Optional[str] = ..., run_id: _Optional[str] = ..., seq: _Optional[int] = ..., sent_at: _Optional[float] = ..., bytes: _Optional[_Iterable[_Union[LinkBytes, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[NodeEvent, _Mapping]]] = ...) -> None: ...

class NodeEvent(_message.Message):
    __slots__ = ("kind", "node", "detail")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    kind: str
    node: str
    detail: str
    def __init__(self, kind: _Optional[str] = ..., node: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "node_id", "message")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    known: bool
    node_id: str
    message: str
    def __init__(self, known: _Optional[bool] = ..., node_id: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
