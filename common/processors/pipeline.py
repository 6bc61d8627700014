"""The processor chain: what happens to a payload between the algorithm and the wire.

A `ProcessorChain` is an ordered list of processors, each `process(message, ctx) -> message`
(the `Processor` protocol; `ctx` a `Context` naming the method, the direction, the peer, the
round and how refusals name the message).  A processor refuses a message by raising
`PayloadError(code, detail)` (common/wire/codec.py): the fabric turns that into the request's
failure, as it does for every built-in check.  The roles never assemble a chain: they ask this
module for the one of a method and direction.

- Inbound replies, `reply_chain` (a client's reply, an edge's partial, at the parent; the
  fabric runs it on every reply it gathers, common/transport/fabric.py):
  `Decompress` (`[compression] up`, common/processors/compressors/; or QSGD by
  `algorithm.compress = "qsgd"`, common/processors/compress.py), then
  `ValidateReply` (the algorithm's reply spec: names, dtypes, shapes, finiteness, its reply
  scalars typed and ranged, the claims the sender may make; common/processors/validation.py), then the
  user's processors.  A reduced partial of a torch.distributed group (server/group_rounds.py,
  edge/group_edge.py) goes through `reduced_chain`: the same chain less the decompression
  (a collective's partial is never QSGD-coded).
- Inbound whole models, `model_chain` (a Fed-CHS hand-off, a WRWGD walk step, a gossip share,
  a final or resumed model): `CheckModel` (exactly the model's names, dtypes, shapes, every
  value finite), then the user's processors.
- Outbound uploads, `upload` (what a child sends its parent): the user's processors, then
  `Compress` (`[compression] up`'s compressor, or QSGD by algorithm.compress, when configured).

The finiteness *policy* (`security.nan_policy`: a refused NaN/Inf reply is left out of the
round, or fails the run) is `FinitenessPolicy`, which the server applies to the refusals of a
round once they are all in (server/coordinator.py).

A user's processors come from the config, `[[processors]]` tables (docs/config.md): each names
a processor by plug-in reference (`name = "mypkg.procs:Counter"`, found by `PROCESSORS`, a
common/util/registry.py `Registry` with no built-ins, and loaded by common/util/plugins.py, so a
client or edge loads only what it was started with), the `methods` and `direction` whose
chains it joins, the `roles` whose processes run it, and its keyword options.  The config loader
loads and constructs each one (`build_processor`), so a bad entry is a config error before any
process starts; each role process, once it holds the run's config, calls `configure(cfg, role)`
(the server's Coordinator, an edge or client process in `parent_config`), which installs fresh
instances of its role's entries.  `install` is the same from Python, in one process.  The
built-ins come first inbound and last outbound, so a user's processor sees the decoded,
validated message and the one the algorithm produced; the config's processors come before the
ones `install` added, in the config's order.
Robust aggregation (common/engine/robust.py) acts on the whole round's replies, not per reply: it is
the aggregation rule, not a processor.  Form and size checks while frames arrive are the
codec's (common/wire/codec.py).
"""
from __future__ import annotations

import functools
import inspect
import math
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Literal, Mapping, MutableMapping, Protocol

import torch

from fedhop.common.processors.compress import compress_upload, decompress_upload
from fedhop.common.processors.compressors.use import decode_upload, encode_upload, for_sender, upload_coding
from fedhop.common.processors.validation import ReplyLimits, reply_bound, validate_reply
from fedhop.common.util.registry import Registry, UnknownName
from fedhop.common.wire.codec import PayloadError, ReplyBound, check_tensors
from fedhop.common.wire.message import REPLY_SCALARS, Payload, ScalarRule, tensor_finite

Spec = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
Direction = Literal["in", "out"]
DIRECTIONS: tuple[Direction, ...] = ("in", "out")
ROLES = ("server", "edge", "client")   # the processes a [[processors]] entry may name
#: the [[processors]] entries' names: plug-ins only (the built-in processors are placed by the chains
#: below, not named in a config), looked up the way every family's kinds are (common/util/registry.py)
PROCESSORS: Registry[Any] = Registry("processor", None, "processors")

__all__ = ["Context", "Processor", "ProcessorChain", "Decompress", "ValidateReply", "CheckModel", "Compress",
           "FinitenessPolicy", "install", "installed", "build_processor", "configure", "unconfigure", "reply_chain",
           "reduced_chain", "model_chain", "upload", "ModelInbound"]


@dataclass(frozen=True)
class Context:
    """What a processor knows of the message in hand.  `method`: the protocol method that
    carries it (common/wire/methods.py; the reply's method for a reply); `direction`: "in" (received)
    or "out" (about to be sent); `peer`: the other end's node id (the sender inbound, the
    receiver outbound) where known, or ""; `who`: how a refusal names the message
    ("round 3 reply of client 7")."""

    method: str
    direction: Direction
    who: str
    round: int = 0
    peer: str = ""
    step: int = 0


class Processor(Protocol):
    """One stage of a chain: returns the message (the same object or a new one), or raises
    PayloadError to refuse it."""

    def process(self, message: Payload, ctx: Context) -> Payload: ...


@dataclass
class ProcessorChain:
    """An ordered list of processors for one method and direction.  Called as the fabric's
    `inbound` (`chain(message, who)`), it runs every processor in order; `bound` is what a reply
    may declare (enforced as it arrives), from the first processor that has one."""

    processors: list[Processor]
    method: str
    direction: Direction = "in"
    round: int = 0
    peer: str = ""
    step: int = 0
    #: the bound, where whoever made the chain worked it out already (`ReplyChains`: once a round)
    known_bound: ReplyBound | None = None

    @property
    def bound(self) -> ReplyBound | None:
        if self.known_bound is not None:
            return self.known_bound
        for p in self.processors:
            b = getattr(p, "bound", None)
            if b is not None:
                return b
        return None

    def process(self, message: Payload, ctx: Context) -> Payload:
        for p in self.processors:
            message = p.process(message, ctx)
        return message

    def __call__(self, message: Payload, who: str) -> Payload:
        return self.process(message, Context(self.method, self.direction, who, self.round, self.peer, self.step))


# ----------------------------------------------------------------------------- built-in processors
@dataclass(frozen=True)
class Decompress:
    """Inbound: a coded upload decoded against the reply spec: `[compression] up`'s compressor
    (common/processors/compressors/use.py; an edge's partial only with compression.edge = "same"),
    or QSGD by `algorithm.compress = "qsgd"` (common/processors/compress.py); a payload as it
    comes when neither is configured."""

    cfg: Any
    spec: Spec
    memory: MutableMapping[str, torch.Tensor] | None = None   # the receiver's EF21 copies (ef21.py)
    # a sparsifier's tensors handed on by their nonzeros (`Payload.sparse`): only where the reply
    # goes straight into a streaming fold (`reply_chain`)
    sparse: bool = False

    @property
    def bound(self) -> ReplyBound | None:
        """With a compressor, the reply bound of the dense spec plus what a code may add to a
        tensor beyond its dense bytes (a bitmap of ceil(d / 8) bytes and 64 bytes of scales)."""
        if upload_coding(self.cfg) is None:
            return None
        dense = reply_bound(self.spec)
        extra = sum((math.prod(shape) + 7) // 8 + 64 for _, shape in self.spec.values())
        return ReplyBound(data_bytes=dense.data_bytes + extra, header_bytes=dense.header_bytes)

    def process(self, message: Payload, ctx: Context) -> Payload:
        coding = for_sender(upload_coding(self.cfg), edge=ctx.method == "edge_round")
        if coding is not None:
            return decode_upload(coding, message, self.spec, self.memory, ctx.peer, ctx.who, self.sparse)
        return decompress_upload(self.cfg, message, self.spec)


@dataclass(frozen=True)
class ValidateReply:
    """Inbound: a reply validated by form and meaning (common/processors/validation.py `validate_reply`):
    the algorithm's reply spec (names, dtypes, shapes, finiteness), its reply scalars typed and
    ranged (`scalars`, default the common ones), the claims the sender may make (`limits`)."""

    spec: Spec
    scalars: Mapping[str, ScalarRule] | None = None
    limits: ReplyLimits | None = None

    @functools.cached_property
    def bound(self) -> ReplyBound:
        """`reply_bound(spec)`, worked out once (the fabric asks when it groups a round's
        requests and again when it sends them)."""
        return reply_bound(self.spec)

    def process(self, message: Payload, ctx: Context) -> Payload:
        validate_reply(message, self.spec, ctx.who, self.scalars if self.scalars is not None else REPLY_SCALARS,
                       self.limits)
        return message


@dataclass(frozen=True)
class CheckModel:
    """Inbound: a whole model, exactly the model's tensor names, dtypes and shapes (`spec`),
    every value finite; raises PayloadError (BAD_NAME, BAD_DTYPE, BAD_SHAPE, NON_FINITE)
    naming the message.  Returns the model's tensors only (with the message's scalars)."""

    spec: Spec

    def process(self, message: Payload, ctx: Context) -> Payload:
        check_tensors(message, self.spec, ctx.who)
        if not all(tensor_finite(t) for t in message.tensors.values()):
            raise PayloadError("NON_FINITE", f"{ctx.who} holds NaN or Inf")
        return Payload(tensors={name: message.tensors[name] for name in self.spec}, scalars=message.scalars,
                       control=message.control)


@dataclass(frozen=True)
class Compress:
    """Outbound: a child's upload coded by `[compression] up`'s compressor, drawn from the stream
    ("compress", sender, round, step), with error feedback's residuals and a stateful compressor's
    memory in `state` (the sender's persistent state; common/processors/compressors/use.py), or QSGD-coded when
    `algorithm.compress = "qsgd"`, drawn from ("qsgd", sender, round, step)
    (common/processors/compress.py)."""

    cfg: Any
    sender: str
    state: MutableMapping[str, torch.Tensor] | None = None

    def process(self, message: Payload, ctx: Context) -> Payload:
        coding = for_sender(upload_coding(self.cfg), edge=ctx.method == "edge_round")
        if coding is not None:
            return encode_upload(coding, message, self.cfg.run.seed, self.sender, ctx.round, ctx.step, self.state)
        return compress_upload(self.cfg, message, self.sender, ctx.round, ctx.step)


@dataclass(frozen=True)
class FinitenessPolicy:
    """`security.nan_policy` over a round's refusals: "reject" leaves a NaN/Inf reply out of the
    round (its NON_FINITE refusal is a failure like any other), "fail" fails the run.  The
    methods return the run's error message, or None where the round goes on."""

    policy: str

    @classmethod
    def of(cls, cfg: Any) -> "FinitenessPolicy":
        return cls(cfg.security.nan_policy)

    def refused_replies(self, round: int, non_finite: str) -> str | None:
        """Replies refused as NON_FINITE (`non_finite`: their client ids, listed)."""
        if self.policy != "fail":
            return None
        return (f"round {round}: non-finite values (NaN/Inf) in the results of clients "
                f"{non_finite} and security.nan_policy = 'fail'")

    def blamed_aggregate(self, round: int, whose: str, blamed: str, first: str, kept: int) -> str | None:
        """An aggregate made non-finite by the results `blamed` (of `whose`: clients or edges),
        `kept` results left without them."""
        if self.policy != "fail" and kept:
            return None
        return (f"round {round}: non-finite values (NaN/Inf) in the aggregate, blamed on {whose} {blamed}: "
                f"{first} (security.nan_policy = '{self.policy}', {kept} results left)")


# ----------------------------------------------------------------------------- the user's processors
@dataclass(frozen=True)
class _Installed:
    processor: Processor
    methods: frozenset[str] | None   # None: every method
    direction: Direction


_installed: list[_Installed] = []
_lock = threading.Lock()


def install(processor: Processor, *, methods: Iterable[str] | None = None,
            direction: Direction = "in") -> Callable[[], None]:
    """Add `processor` to the chains of `methods` (None: every method) in `direction`, after the
    installed ones; returns the function that removes it.  Install it in every process whose
    chains should run it (the module docstring)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"install: direction must be one of {', '.join(DIRECTIONS)}, not {direction!r}")
    if not callable(getattr(processor, "process", None)):
        raise TypeError(f"install: {processor!r} has no process(message, ctx) method")
    entry = _Installed(processor, None if methods is None else frozenset(str(m) for m in methods), direction)
    with _lock:
        _installed.append(entry)

    def remove() -> None:
        with _lock:
            if entry in _installed:
                _installed.remove(entry)
    return remove


def installed(method: str, direction: Direction) -> list[Processor]:
    """The user's processors for `method` and `direction`: the config's (`configure`), then those
    `install` added, each in order."""
    with _lock:
        entries = [e for e, roles in _configured if roles & _configured_roles] + _installed
        return [e.processor for e in entries
                if e.direction == direction and (e.methods is None or str(method) in e.methods)]


# ----------------------------------------------------------------------------- ... from the config
_configured: list[tuple[_Installed, frozenset[str]]] = []   # the config's entries and the roles that run them
_configured_from: tuple[Any, ...] | None = None             # the [[processors]] they were built from
_configured_roles: set[str] = set()                         # the roles this process plays


def _methods() -> tuple[str, ...]:
    from fedhop.common.wire.methods import Method  # local: the method registry imports the ledger
    return tuple(m.value for m in Method)


def build_processor(entry: Any, key: str = "processors[0]") -> Processor:
    """The processor of one `[[processors]]` entry (`common.config_schema.ProcessorConfig`, `key`
    its place for errors): its methods and roles checked, its reference loaded as a plug-in of
    group `fedhop.processors` (refused unless allowed, and only an object defined in the module
    it names, common/util/plugins.py), its kind checked before anything is called (a class must
    define `process`), the entry's options bound to the class's or factory's signature, and only
    then called with them; an object with `process` is taken as it is, without options.  The
    options come from whoever wrote the config, a client's parent too: nothing is called with
    options it does not take.  Raises ValueError, one line naming the key."""
    from fedhop.common.util.plugins import PluginError
    if not entry.name:
        raise ValueError(f"config key '{key}.name' is required: the processor, \"package.module:Class\"")
    methods = _methods()
    for j, method in enumerate(entry.methods):
        if method not in methods:
            raise ValueError(f"config key '{key}.methods[{j}]': got {method!r}, allowed: {', '.join(methods)}")
    if not entry.roles:
        raise ValueError(f"config key '{key}.roles': got [], a processor no process runs (allowed: "
                         f"{', '.join(ROLES)})")
    for j, role in enumerate(entry.roles):
        if role not in ROLES:
            raise ValueError(f"config key '{key}.roles[{j}]': got {role!r}, allowed: {', '.join(ROLES)}")
    if entry.direction not in DIRECTIONS:
        raise ValueError(f"config key '{key}.direction': got {entry.direction!r}, allowed: {', '.join(DIRECTIONS)}")
    try:
        obj = PROCESSORS.get(entry.name)   # its kind checked, nothing called
    except (PluginError, UnknownName) as exc:   # PluginRefused too: never imported, or never reached
        raise ValueError(f"config key '{key}.name': {exc}") from None
    processor: Any
    if inspect.isclass(obj) or inspect.isroutine(obj):   # a class defining process, or a factory
        _check_options(obj, entry, key)
        try:
            processor = obj(**entry.options)
        except Exception as exc:   # noqa: BLE001 - the user's constructor: reported, not raised
            raise ValueError(f"config key '{key}': {entry.name}(...) raised {type(exc).__name__}: {exc}") from None
    elif entry.options:
        raise ValueError(f"config key '{key}': {entry.name} is an object, not a class or factory, so it takes no "
                         f"options (given: {', '.join(entry.options)})")
    else:
        processor = obj
    if not callable(getattr(processor, "process", None)):
        raise ValueError(f"config key '{key}.name': {entry.name} gives a {type(processor).__name__} without a "
                         f"process(message, ctx) method")
    return processor


def _check_options(make: Callable[..., Any], entry: Any, key: str) -> None:
    """The entry's options against the signature of the class or factory `make`, before it is
    called: an option it does not take is named (a typo), then a missing one; a callable whose
    signature cannot be read is refused (its options cannot be checked)."""
    try:
        params = inspect.signature(make).parameters
    except (TypeError, ValueError):
        raise ValueError(f"config key '{key}.name': {entry.name} has no signature to check its options "
                         f"against") from None
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = [k for k in entry.options if k not in named]
        if unknown:
            raise ValueError(f"config key '{key}.{unknown[0]}': {entry.name} takes no option {unknown[0]!r} (its "
                             f"options: {', '.join(named) or 'none'})")
    try:
        inspect.signature(make).bind(**entry.options)
    except TypeError as exc:
        raise ValueError(f"config key '{key}': {entry.name}: {exc} (options given: "
                         f"{', '.join(entry.options) or 'none'})") from None


def configure(cfg: Any, role: str) -> None:
    """Run `cfg.processors` of `role` (server, edge or client) in this process's chains (module
    docstring).  A config with other processors than the last one configured replaces them (fresh
    instances); the same config for another role adds that role's (every role in one process:
    deploy/launch/inmemory.py).  Call it before the role builds its chains."""
    if role not in ROLES:
        raise ValueError(f"configure: role must be one of {', '.join(ROLES)}, not {role!r}")
    global _configured_from
    entries = tuple(cfg.processors)
    with _lock:
        same = entries == _configured_from
    if not same:
        built = [(_Installed(build_processor(e, f"processors[{i}]"), frozenset(e.methods) or None, e.direction),
                  frozenset(e.roles)) for i, e in enumerate(entries)]
    with _lock:
        if not same:
            _configured[:] = built
            _configured_from = entries
            _configured_roles.clear()
        _configured_roles.add(role)


def unconfigure() -> None:
    """Remove the config's processors from this process (tests)."""
    global _configured_from
    with _lock:
        _configured.clear()
        _configured_roles.clear()
        _configured_from = None


# ----------------------------------------------------------------------------- the chains
def reply_chain(cfg: Any, spec: Spec, method: str, scalars: Mapping[str, ScalarRule] | None = None,
                limits: ReplyLimits | None = None, *, round: int = 0, peer: str = "",
                memory: MutableMapping[str, torch.Tensor] | None = None, folded: bool = False) -> ProcessorChain:
    """The inbound chain of a reply to `method`: Decompress (`memory`: the receiver's EF21
    copies of its senders' estimates), ValidateReply, the user's.  `folded`: the reply goes
    straight into a streaming fold (common/processors/streaming.py), so a sparsifier's tensors
    may stay their nonzeros (`Payload.sparse`) unless a user's processor reads the reply (it
    gets dense tensors, as everywhere else).  A round's chains for many peers: `ReplyChains`."""
    return ReplyChains(cfg, spec, method, scalars, round=round, memory=memory, folded=folded).chain(peer, limits)


class ReplyChains:
    """The inbound chains of one round's replies to `method`, one a peer (`chain`), each what
    `reply_chain` makes.  What does not depend on the peer is made once: the Decompress step,
    the user's processors and the reply bound, which the fabric reads twice a request (when it
    groups a round's requests and when it sends them).  A round of 1,000 sampled clients then
    builds 1,000 ValidateReply steps and chains, not 1,000 of every part (docs/performance.md,
    "A round's fixed work per sampled client")."""

    def __init__(self, cfg: Any, spec: Spec, method: str, scalars: Mapping[str, ScalarRule] | None = None, *,
                 round: int = 0, memory: MutableMapping[str, torch.Tensor] | None = None,
                 folded: bool = False) -> None:
        self.spec, self.scalars, self.method, self.round = spec, scalars, str(method), round
        self.users = installed(method, "in")
        self.decompress = Decompress(cfg, spec, memory, sparse=folded and not self.users)
        self.bound = self.decompress.bound or reply_bound(spec)   # ValidateReply's when there is no coding

    def chain(self, peer: str = "", limits: ReplyLimits | None = None) -> ProcessorChain:
        """The chain of `peer`'s reply, under the claims it may make (`limits`)."""
        return ProcessorChain([self.decompress, ValidateReply(self.spec, self.scalars, limits), *self.users],
                              self.method, "in", self.round, peer, known_bound=self.bound)


def reduced_chain(spec: Spec, method: str, *, round: int = 0, peer: str = "") -> ProcessorChain:
    """The inbound chain of a torch.distributed group's reduced partial (never QSGD-coded):
    ValidateReply with the common reply scalars, the user's."""
    return ProcessorChain([ValidateReply(spec), *installed(method, "in")], str(method), "in", round, peer)


@dataclass
class ModelInbound:
    """The inbound chain of a whole model for `method`, called as `(message, what)`: the model's
    tensors (a dict in the spec's order)."""

    chain: ProcessorChain
    spec: Spec

    def __call__(self, message: Payload, what: str, round: int = 0, peer: str = "") -> dict[str, torch.Tensor]:
        chain = self.chain if (round, peer) == (0, "") else replace(self.chain, round=round, peer=peer)
        out = chain(message, what)
        return {name: out.tensors[name] for name in self.spec}


def model_chain(spec: Spec, method: str) -> ModelInbound:
    """The inbound chain of a whole model arriving by `method`: CheckModel, the user's."""
    return ModelInbound(ProcessorChain([CheckModel(spec), *installed(method, "in")], str(method), "in"), spec)


def upload(cfg: Any, payload: Payload, sender: str, round: int, step: int = 0, method: str = "train",
           peer: str = "", state: MutableMapping[str, torch.Tensor] | None = None) -> Payload:
    """The outbound chain of a child's reply to its parent (`method`: the call it answers): the
    user's processors, then Compress (`state`: the sender's persistent state, for error feedback
    and stateful compressors)."""
    chain = ProcessorChain([*installed(method, "out"), Compress(cfg, sender, state)], str(method), "out", round,
                           peer, step)
    return chain(payload, f"round {round} upload of {sender}")

