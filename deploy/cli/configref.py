"""The config reference, generated from the schema: docs/config.md and `fedhop config show`.

Nothing here lists keys by hand.  The common keys are the fields of the section dataclasses
(common/config/schema.py); the keys that depend on a choice (an algorithm's hyper-parameters, a
topology's, a data set's, the torch transport's, the [clients] device keys) are the fields of the
`Params` dataclass that the config loader validates them against (`options_schema`,
common/config/__init__.py), for every built-in choice.  For each key: its type (the annotation), default,
allowed values (the `choices` / `min` / `max` / `min_exclusive` rules the loader enforces) and
its description: the field's `help` metadata, else the "`key`: ..." entry of its class
docstring, else the comment on (or just above) its line in the source, else a docstring entry
shared by several keys ("`a`, `key`: ...").

    python -m fedhop.deploy.cli.configref --write docs/config.md   # regenerate the committed page
    fedhop config show [ALGORITHM] [--toml]
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable

from fedhop.common.config import (
    SECTIONS,
    config_to_toml,
    eval_annotation,
    field_default,
    options_chooser,
    options_schema,
    parse_config,
    shadowed_keys,
    toml_value,
)
from fedhop.common.util.cliparser import ArgumentParser
from fedhop.deploy.cli.pagegen import page_main

REGENERATE = "python -m fedhop.deploy.cli.configref --write docs/config.md"
UNSET = "unset"   # the default of an optional key (None): not written; the code picks its value


# ----------------------------------------------------------------------------- one key
@dataclass(frozen=True)
class KeyDoc:
    """One config key as the reference shows it."""

    section: str
    key: str
    type: str
    default: Any            # the Python default (None: unset)
    allowed: str            # "" when any value of the type is accepted
    help: str

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"

    @property
    def default_text(self) -> str:
        return UNSET if self.default is None else toml_value(self.default, self.name)


@dataclass(frozen=True)
class Group:
    """The keys one choice (or several choices sharing a Params class) adds to a section."""

    section: str
    chooser: str             # the key that picks the schema (algorithm.name, topology.kind, ...)
    choices: tuple[str, ...] # built-in choices with this schema; () when it applies whatever the choice
    summary: str
    keys: tuple[KeyDoc, ...]


_TYPE_NAMES = {int: "int", float: "float", str: "string", bool: "bool", list: "array", tuple: "array",
               dict: "table", type(None): UNSET}


def type_text(annotation: Any) -> str:
    """`int | float` -> "int or float", `list[int]` -> "array of int", `float | None` -> "float or unset"."""
    if isinstance(annotation, str):
        annotation = eval_annotation(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_text(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return " or ".join(sorted({_TYPE_NAMES.get(type(a), type(a).__name__) for a in typing.get_args(annotation)}))
    if origin in (list, tuple) and typing.get_args(annotation):
        return f"array of {type_text(typing.get_args(annotation)[0])}"
    if origin is not None:
        return _TYPE_NAMES.get(origin, getattr(origin, "__name__", str(origin)))
    if annotation is typing.Any or annotation is object:
        return "any"
    return _TYPE_NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _number(v: Any) -> str:
    return toml_value(v)


def allowed_text(annotation: Any, rules: typing.Mapping[str, Any]) -> str:
    """The values the loader accepts, from the field's rules (and a Literal annotation)."""
    if "choices" in rules:
        return ", ".join(toml_value(c) for c in rules["choices"])
    if isinstance(annotation, str):
        annotation = eval_annotation(annotation)
    literals = [a for m in (typing.get_args(annotation) or (annotation,)) if typing.get_origin(m) is typing.Literal
                for a in typing.get_args(m)]
    if typing.get_origin(annotation) is typing.Literal:
        literals = list(typing.get_args(annotation))
    if literals:
        return ", ".join(toml_value(a) for a in literals)
    lo = (">=", rules["min"]) if "min" in rules else (">", rules["min_exclusive"]) if "min_exclusive" in rules else None
    hi = ("<=", rules["max"]) if "max" in rules else ("<", rules["max_exclusive"]) if "max_exclusive" in rules else None
    if lo and hi:
        return f"{'[' if lo[0] == '>=' else '('}{_number(lo[1])}, {_number(hi[1])}{']' if hi[0] == '<=' else ')'}"
    if lo:
        return f"{lo[0]} {_number(lo[1])}"
    if hi:
        return f"{hi[0]} {_number(hi[1])}"
    return ""


# ----------------------------------------------------------------------------- descriptions
def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


@lru_cache(maxsize=None)
def _source_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment on its line (and continuation lines) or just above it, in `cls`'s source."""
    try:
        lines, first = inspect.getsourcelines(cls)
    except (OSError, TypeError):   # no source (a class made at run time)
        return {}
    source = textwrap.dedent("".join(lines))
    comments: dict[int, tuple[int, str]] = {}   # line (1-based in `source`) -> (column, text)
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = (tok.start[1], tok.string.lstrip("#").strip())
        tree = ast.parse(source)
    except (tokenize.TokenError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    src_lines = source.splitlines()
    comment_lines = {i + 1 for i, text in enumerate(src_lines) if text.strip().startswith("#")}
    out: dict[str, str] = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        parts: list[str] = []
        above: list[str] = []
        line = node.lineno - 1
        while line in comment_lines and comments.get(line, (None,))[0] == node.col_offset:
            above.insert(0, comments[line][1])
            line -= 1
        parts += above
        end = node.end_lineno or node.lineno   # always set on a parsed node
        trailing = [comments[n][1] for n in range(node.lineno, end + 1)
                    if n in comments and n not in comment_lines]
        if trailing:
            column = comments[end][0] if end in comments else None
            line = end + 1
            while column is not None and line in comment_lines and comments[line][0] == column:
                trailing.append(comments[line][1])   # a trailing comment continued under itself
                line += 1
        parts += trailing
        if parts:
            out[node.target.id] = _squash(" ".join(parts))
    return out


def _docstring_entry(cls: type, name: str, shared: bool = False) -> str:
    """The "`name`: text" entry of a class docstring (up to the next such entry or paragraph);
    with `shared`, also an entry for several keys at once ("`a`, `name`: text")."""
    doc = cls.__dict__.get("__doc__") or ""
    names = rf"(?:`\w+`,\s*)*`{re.escape(name)}`(?:,\s*`\w+`)*" if shared else rf"`{re.escape(name)}`"
    m = re.search(rf"(?:^|(?<!,)\s){names}:\s*(.+?)(?=\s+`\w+`(?:,\s*`\w+`)*:|\n\s*\n|$)", doc, re.S)
    return _squash(m.group(1)) if m else ""


def field_help(cls: type, f: dataclasses.Field) -> str:
    """A field's description: `help` metadata, else its class docstring entry, else its source comment."""
    if f.metadata.get("help"):
        return _squash(f.metadata["help"])
    for klass in cls.__mro__:   # the classes that declare the field, nearest first
        if f.name in klass.__dict__.get("__annotations__", {}):
            found = _docstring_entry(klass, f.name) or _source_comments(klass).get(f.name) \
                or _docstring_entry(klass, f.name, shared=True)
            if found:
                return found
    return ""


def dataclass_keys(section: str, cls: type, skip: Iterable[str] = ("options",)) -> tuple[KeyDoc, ...]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:   # an annotation that does not resolve: the loader falls back the same way
        hints = {}
    out = []
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        annotation = hints.get(f.name, f.type)
        default = field_default(f)
        out.append(KeyDoc(section, f.name, type_text(annotation), None if default is dataclasses.MISSING else default,
                          allowed_text(annotation, f.metadata), field_help(cls, f)))
    return tuple(out)


def summary_of(obj: Any) -> str:
    """The first paragraph of `obj`'s own docstring, else of its module's."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    if isinstance(obj, type) and doc and doc.startswith(f"{obj.__name__}("):
        doc = None   # the signature @dataclass writes when a class has no docstring
    if not doc and isinstance(obj, type):
        doc = getattr(sys.modules.get(obj.__module__), "__doc__", None)
    return _squash((doc or "").strip().split("\n\n")[0])


# ----------------------------------------------------------------------------- the whole schema
def _builtin_choices(section: str) -> tuple[str, ...] | None:
    """The built-in values of `section`'s chooser key (None: its schema does not depend on it)."""
    if section == "algorithm":
        from fedhop.common.algorithms import registry
        return tuple(sorted(registry()))
    if section == "topology":
        from fedhop.common.topologies.graphs import TOPOLOGY_PARAMS
        return tuple(TOPOLOGY_PARAMS)
    if section == "data":
        from fedhop.common.tasks import builtin_datasets
        return tuple(builtin_datasets())
    if section == "compression":
        from fedhop.common.processors.compressors import NONE, builtin_compressors
        return (NONE, *sorted(builtin_compressors()))
    if section == "transport":
        from fedhop.common.transport.factory import TRANSPORTS
        return tuple(TRANSPORTS)
    chooser = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == options_chooser(section))
    return tuple(chooser.metadata["choices"]) if "choices" in chooser.metadata else None


def chooser_allowed(section: str, key: str) -> str:
    """Allowed values of a chooser key: its built-in choices (plug-ins may add more)."""
    choices = _builtin_choices(section) if section in CHOOSER_SECTIONS and options_chooser(section) == key else None
    if choices is None:
        return ""
    plugin = {"algorithm": "an algorithm plug-in", "topology": "a topology plug-in", "data": "a data-set plug-in",
              "compression": "a compressor plug-in", "transport": "a transport plug-in"}
    return ", ".join(toml_value(c) for c in choices) + (f", or {plugin[section]}" if section in plugin else "")


def _option_sections() -> tuple[str, ...]:
    out = []
    for section in SECTIONS:
        try:
            options_chooser(section)
        except KeyError:
            continue
        out.append(section)
    return tuple(out)


CHOOSER_SECTIONS = _option_sections()


def common_keys(section: str) -> tuple[KeyDoc, ...]:
    keys = dataclass_keys(section, SECTIONS[section])
    return tuple(dataclasses.replace(k, allowed=k.allowed or chooser_allowed(section, k.key)) for k in keys)


def groups(section: str) -> tuple[Group, ...]:
    """The choice-dependent keys of `section`: one group per Params class, built-in choices only."""
    if section not in CHOOSER_SECTIONS:
        return ()
    chooser = options_chooser(section)
    choices = _builtin_choices(section)
    if choices is None:   # the same keys whatever the choice ([clients] device keys)
        default = field_default(next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == chooser))
        cls = options_schema(section, default)
        return (_group(section, chooser, (), cls, cls),) if cls is not None else ()
    by_class: dict[type, list[str]] = {}
    for choice in choices:
        cls = options_schema(section, choice)
        if cls is not None and dataclasses.fields(cls):
            by_class.setdefault(cls, []).append(choice)
    return tuple(_group(section, chooser, tuple(names), cls, _described(section, names, cls))
                 for cls, names in by_class.items())


def choices_without_keys(section: str) -> tuple[str, ...]:
    """Built-in choices that add no keys to `section`."""
    choices = _builtin_choices(section) or ()
    return tuple(c for c in choices if not any(c in g.choices for g in groups(section)))


def _own_doc(cls: type) -> bool:
    doc = cls.__dict__.get("__doc__")
    return isinstance(doc, str) and bool(doc) and not doc.startswith(f"{cls.__name__}(")


def _described(section: str, choices: list[str], cls: type) -> Any:
    """What describes a group: the one algorithm's class docstring, else its Params' (else module's)."""
    if section == "algorithm" and len(choices) == 1:
        from fedhop.common.algorithms import algorithm_class
        owner = algorithm_class(choices[0])
        if _own_doc(owner):
            return owner
    return cls


def _group(section: str, chooser: str, choices: tuple[str, ...], cls: type, described: Any) -> Group:
    shadowed = set(shadowed_keys(section, cls))
    keys = tuple(dataclasses.replace(k, help=f"{k.help} (shadowed: `{section}.{k.key}` sets the common key of "
                                             f"the same name, so this one stays at its default)".lstrip())
                 if k.key in shadowed else k for k in dataclass_keys(section, cls))
    return Group(section, chooser, choices, summary_of(described), keys)


def all_keys() -> list[KeyDoc]:
    """Every key of the reference: the common keys, then each group's."""
    out: list[KeyDoc] = []
    for section in SECTIONS:
        out += common_keys(section)
        for group in groups(section):
            out += group.keys
    return out


SECTION_TITLES = {name: summary_of(cls) for name, cls in SECTIONS.items()}


# ----------------------------------------------------------------------------- markdown (docs/config.md)
def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def _table(keys: Iterable[KeyDoc]) -> list[str]:
    lines = ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
    for k in keys:
        default = UNSET if k.default is None else _code(k.default_text)
        lines.append(f"| `{k.key}` | {_cell(k.type)} | {_cell(default)} | {_cell(k.allowed)} | {_cell(k.help)} |")
    return lines


_INTRO = """\
# Configuration reference

<!-- Generated from the config schema by deploy/cli/configref.py; do not edit by hand.
     Regenerate: {regenerate} -->

An experiment is one TOML file of sections (`[run]`, `[topology]`, `[algorithm]`, `[data]`,
`[model]`, `[clients]`, `[transport]`, `[security]`); every key is optional and takes the default
below.  `fedhop run exp.toml --set SECTION.KEY=VALUE` overrides a key from the command line.  A key
that does not exist, a value of the wrong type or outside the allowed values is refused before
any process starts, with one line naming the key, and exit status 2.

Each section has **common keys**, and some sections have keys that belong to a choice: the
algorithm's own hyper-parameters (`algorithm.name`), the topology's (`topology.kind`), the data
set's (`data.dataset`), the torch transport's (`transport.kind = "torch"`), and the device and
straggler keys of `[clients]`.  They are written flat in their section (`[algorithm]` `name =
"fedadam"`, `beta1 = 0.9`); a key of another choice is refused.  A plug-in (an algorithm, topology
or data set given as `package.module:Name`) brings its own keys: `fedhop config show NAME` lists an
algorithm plug-in's.

Each run writes `config.toml` into its run folder: every key of the run's config, resolved,
including the defaults of the chosen algorithm, topology and data set (an optional key left unset
is written as a comment, `# key: unset`).  Loading that file gives the same config; the server, the
edges, the clients and `fedhop run --resume` read it.

On the command line: `fedhop config show` prints this reference, `fedhop config show ALGORITHM`
the common keys and that algorithm's own, and `fedhop config show --toml ALGORITHM` a complete
config file with every key at its default.
"""


def markdown() -> str:
    """docs/config.md."""
    lines = [_INTRO.format(regenerate=REGENERATE)]
    lines.append("Sections: " + ", ".join(f"[`[{s}]`](#{s})" for s in SECTIONS) + ", and the array of tables "
                 "[`[[processors]]`](#processors).\n")
    for section in SECTIONS:
        lines.append(f"## [{section}]\n")
        if SECTION_TITLES[section]:
            lines.append(SECTION_TITLES[section] + "\n")
        gs = groups(section)
        if gs:
            lines.append("Common keys:\n")
        lines += _table(common_keys(section))
        lines.append("")
        if not gs:
            continue
        chooser = gs[0].chooser
        if gs[0].choices:
            lines.append(f"### Keys of each {section} choice (`{section}.{chooser}`)\n")
            none = choices_without_keys(section)
            if none:
                lines.append(f"No keys of their own: {', '.join(f'`{c}`' for c in none)}.\n")
        for g in gs:
            if g.choices:
                lines.append(f"#### {', '.join(f'`{c}`' for c in g.choices)}\n")
            else:
                lines.append(f"### Further [{section}] keys\n")
            if g.summary:
                lines.append(g.summary + "\n")
            lines += _table(g.keys)
            lines.append("")
    lines += _processors_markdown()
    return "\n".join(lines).rstrip() + "\n"


_PROCESSORS = """\
## [[processors]]

{summary}  A processor is a user's stage in the payload chains (common/processors/pipeline.py;
docs/architecture.md, "Add a processor"): it sees each message of its methods and direction, after
the built-in decoding and validation inbound and before compression outbound, and returns it
(changed or not) or refuses it by raising `PayloadError(code, detail)`, which the run treats as it
treats a built-in refusal (a refused reply is left out of its round and recorded in run.db).  The
entries are loaded, checked and constructed when the config loads; every process that reads the
config imports them, so a client or edge process must be started with each one on its allow-list
(`--allow-plugin MODULE`; `fedhop run` passes its children the ones its config names).

```toml
[[processors]]
name = "myprocs:Count"        # myprocs.py beside the config
methods = ["train"]
direction = "in"
roles = ["server"]
path = "counts.txt"           # an option: Count(path="counts.txt")
```
"""


def _processors_markdown() -> list[str]:
    """The `[[processors]]` tables: an array of tables after the sections."""
    from fedhop.common.config.schema import ProcessorConfig
    return [_PROCESSORS.format(summary=summary_of(ProcessorConfig)), *_table(dataclass_keys("processors",
                                                                                          ProcessorConfig)), ""]


# ----------------------------------------------------------------------------- terminal
def _text_keys(keys: Iterable[KeyDoc], width: int = 100) -> list[str]:
    lines = []
    for k in keys:
        facts = k.type + (f"; allowed: {k.allowed}" if k.allowed else "")
        lines.append(f"  {k.key} = {k.default_text}    ({facts})")
        if k.help:
            lines += textwrap.wrap(k.help, width, initial_indent="      ", subsequent_indent="      ")
    return lines


def algorithm_group(name: str) -> Group | None:
    """The keys of algorithm `name`: a built-in's group, or a plug-in's Params (loaded now)."""
    for g in groups("algorithm"):
        if name in g.choices:
            return g
    cls = options_schema("algorithm", name)   # KeyError / ValueError for an unknown name or a bad plug-in
    if cls is None or not dataclasses.fields(cls):
        return None
    return _group("algorithm", "name", (name,), cls, _described("algorithm", [name], cls))


def text(algorithm: str | None = None) -> str:
    """`fedhop config show [ALGORITHM]`: the reference for a terminal."""
    out: list[str] = ["Every config key as KEY = DEFAULT (TYPE; allowed values), then its description "
                      "(docs/config.md).", ""]
    only = algorithm_group(algorithm) if algorithm else None
    for section in SECTIONS:
        out.append(f"[{section}]" + (f"  {SECTION_TITLES[section]}" if SECTION_TITLES[section] else ""))
        keys = common_keys(section)
        if algorithm and section == "algorithm":
            keys = tuple(dataclasses.replace(k, default=algorithm) if k.key == "name" else k for k in keys)
        out += _text_keys(keys)
        for g in groups(section):
            if algorithm and section == "algorithm":
                continue
            if algorithm and g.choices:   # with an algorithm: only keys that apply whatever the other choices
                continue
            out.append(f"  -- keys of {section}.{g.chooser} = " + " | ".join(g.choices) if g.choices
                       else f"  -- further [{section}] keys")
            out += _text_keys(g.keys)
        if algorithm and section == "algorithm":
            if only is None:
                out.append(f"  -- {algorithm} has no keys of its own")
            else:
                out.append(f"  -- keys of algorithm {algorithm}" + (f": {only.summary}" if only.summary else ""))
                out += _text_keys(only.keys)
        out.append("")
    if algorithm:
        out.append("Keys of each topology, data set and the torch transport: fedhop config show")
    return "\n".join(out).rstrip() + "\n"


# ----------------------------------------------------------------------------- an example config
def example_config(algorithm: str) -> str:
    """A complete config for `algorithm`: what a run's config.toml holds, each key under its description.

    A sequential algorithm (one model walks the edges) is paired with topology.kind = "sequential"
    and 2 edges, which it needs to load."""
    from fedhop.common.algorithms import algorithm_class
    overrides = [f"algorithm.name={algorithm}"]
    if getattr(algorithm_class(algorithm), "sequential", False):
        overrides += ["topology.kind=sequential", "topology.edges=2"]
    cfg = parse_config("", overrides)
    helps = {k.name: k.help for k in common_keys_all()}
    helps.update({k.name: k.help for k in (algorithm_group(algorithm) or Group("", "", (), "", ())).keys})
    for section in ("topology", "data", "transport", "clients"):
        for g in groups(section):
            if not g.choices or getattr(getattr(cfg, section), g.chooser) in g.choices:
                helps.update({k.name: k.help for k in g.keys})
    out = [f"# fedhop config: every key at its default for algorithm.name = {toml_value(algorithm)}",
           f"# (fedhop config show --toml {algorithm}; the reference: docs/config.md)"]
    section = ""
    for line in config_to_toml(cfg).splitlines():
        m = re.match(r"\[(\w+)\]$", line)
        if m:
            section = m.group(1)
            out += ["", line]
            continue
        key = re.match(r"(?:# )?([\w-]+)(?: =|:)", line)
        if key and helps.get(f"{section}.{key.group(1)}"):
            out += textwrap.wrap(helps[f"{section}.{key.group(1)}"], 98, initial_indent="# ", subsequent_indent="# ")
        if line:
            out.append(line)
    return "\n".join(out).strip() + "\n"


def common_keys_all() -> list[KeyDoc]:
    return [k for section in SECTIONS for k in common_keys(section)]


# ----------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    """`fedhop config show [ALGORITHM] [--toml]` and `--write PATH` (docs/config.md)."""
    ap = ArgumentParser(prog="fedhop config", description="the config reference, generated from the schema")
    sub = ap.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="print every config key: type, default, allowed values, description")
    show.add_argument("algorithm", nargs="?", help="the common keys and this algorithm's own (built in or a plug-in)")
    show.add_argument("--toml", action="store_true", help="a complete config file for ALGORITHM, every key at its default")
    args = ap.parse_args(argv)
    if args.algorithm is not None and not args.algorithm.strip():
        ap.error("show: the ALGORITHM given is empty (name one, e.g. fedavg, or leave it out for the common keys)")
    if args.toml and not args.algorithm:
        ap.error("show --toml needs an ALGORITHM (e.g. fedhop config show --toml fedavg)")
    try:
        if args.toml:
            sys.stdout.write(example_config(args.algorithm))
        else:
            sys.stdout.write(text(args.algorithm))
    except (KeyError, ValueError, ImportError) as exc:   # an unknown algorithm, a plug-in that does not load
        why = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
        print(f"fedhop config show: {why}", file=sys.stderr)
        return 2
    return 0


def _module_main(argv: list[str] | None = None) -> int:
    """`python -m fedhop.deploy.cli.configref [--write PATH | --check PATH]`: docs/config.md."""
    return page_main("python -m fedhop.deploy.cli.configref", "the schema", markdown, REGENERATE, argv)


if __name__ == "__main__":
    sys.exit(_module_main())
