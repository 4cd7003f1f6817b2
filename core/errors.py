"""Errors that cross the core/app boundary.

`UserError` is anything the person at the keyboard can fix (a bad path, an unsupported model,
a malformed option). The command line prints its message as one line and exits with status 2;
the window shows it and keeps working. Everything else is an internal failure.

A message names an option with `mention` (``mention("allow_pickle")``), never by one front end's
spelling: each front end words it its own way (`UserError.words`): ``--allow-pickle`` on the
command line, ``allow_pickle=True`` in Python (``str(exc)``), the control's label in the window.
"""

from __future__ import annotations

import re
from typing import Any, Literal

Front = Literal["python", "cli", "window"]

_MENTION = re.compile("\x1e([a-z_]+)\x1f([^\x1e\x1f]*)\x1f([^\x1e\x1f]*)\x1f([^\x1e\x1f]*)\x1e")
_UNSET = object()


def mention(name: str, value: Any = _UNSET, metavar: str = "") -> str:
    """An option (a `RunSpec` field, or another command's option such as ``tolerance``) named in
    a message: ``value`` is the value to give it (``mention("device", "cpu")``), ``metavar`` a
    placeholder for one (``mention("image", metavar="FILE")``)."""
    if value is _UNSET:
        return f"\x1e{name}\x1f\x1f\x1f{metavar}\x1e"
    cli = "" if isinstance(value, bool) else str(value)
    return f"\x1e{name}\x1f{value!r}\x1f{cli}\x1f{metavar}\x1e"


def words(message: str, front: Front) -> str:
    """``message`` with its mentioned options worded for ``front``."""
    return _MENTION.sub(lambda m: _word(m.group(1), m.group(2), m.group(3), m.group(4), front),
                        message)


def _word(name: str, py: str, cli: str, metavar: str, front: Front) -> str:
    from . import spec  # the spec imports this module: looked up when a message is worded

    meta = spec.option(name) if name in spec.names() else None
    is_bool = meta is not None and spec.field_type(name) is bool
    if front == "cli" or (front == "window" and (meta is None or meta.label is None)):
        if meta is not None and meta.cli == "negated" and py == "False":
            return spec.flag(name)
        text = spec.flag(name) if meta is not None else "--" + name.replace("_", "-")
        return " ".join(t for t in (text, cli or metavar) if t)
    if front == "window":
        assert meta is not None and meta.label is not None
        said = f"'{meta.said or meta.label}'"
        return f"{said}: {cli}" if cli else said
    if py:
        return f"{name}={py}"
    if metavar:
        return f"{name}=..."
    return f"{name}=True" if is_bool else name


class UserError(Exception):
    """A problem with the user's input, reported as one clear line (``str()`` words its options
    as Python does; `words` for another front end)."""

    def __str__(self) -> str:
        return words(super().__str__(), "python")

    def words(self, front: Front) -> str:
        """The message with its options worded for ``front``."""
        return words(super().__str__(), front)


class Cancelled(Exception):
    """Raised inside a run when `should_stop()` answered True; never reaches the user."""
