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
    __slots__ = ("run_id", "round", "step", "src", "dst", "method", "msg_id", "tensors", "scalars", "data_bytes", "error", "token", "data_xxh3")
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
    DATA_XXH3_FIELD_NUMBER: _ClassVar[int]
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
    data_xxh3: int
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., step: _Optional[int] = ..., src: _Optional[str] = ..., dst: _Optional[str] = ..., method: _Optional[str] = ..., msg_id: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., scalars: _Optional[_Mapping[str, Scalar]] = ..., data_bytes: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., token: _Optional[str] = ..., data_xxh3: _Optional[int] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: Envelope
    data: bytes
    def __init__(self, header: _Optional[_Union[Envelope, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

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
    __slots__ = ("node_id", "role", "address", "clients", "token", "run_id", "msg_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MSG_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    address: str
    clients: _containers.RepeatedCompositeFieldContainer[LogicalClient]
    token: str
    run_id: str
    msg_id: str
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., clients: _Optional[_Iterable[_Union[LogicalClient, _Mapping]]] = ..., token: _Optional[str] = ..., run_id: _Optional[str] = ..., msg_id: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("node_id", "run_id", "seq", "sent_at", "bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    run_id: str
    seq: int
    sent_at: float
    bytes: _containers.RepeatedCompositeFieldContainer[LinkBytes]
    def __init__(self, node_id: _Optional[str] = ..., run_id: _Optional[str] = ..., seq: _Optional[int] = ..., sent_at: _Optional[float] = ..., bytes: _Optional[_Iterable[_Union[LinkBytes, _Mapping]]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "node_id", "message")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    known: bool
    node_id: str
    message: str
    def __init__(self, known: _Optional[bool] = ..., node_id: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
