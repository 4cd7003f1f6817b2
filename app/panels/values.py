"""What a panel restores, checked value by value: the window settings read back from QSettings (a
file anyone can edit), a session's inputs and options, the command line's options.

A value of the wrong type or an absurd size is dropped, with a warning in the log, and its control
keeps its default, so that whatever the settings file holds the window starts. The run's options
are checked by the run's own check (`core.spec.from_options`, `RunSpec.validate`); a panel's own
values (the recent models, a placement as typed) by the checks the panel gives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("ctxpatch")

#: a panel's own value -> why it cannot be restored (None: it can)
Check = Callable[[Any], "str | None"]


def checked(data: Any, source: str, own: Mapping[str, Check] | None = None) -> dict[str, Any]:
    """``data`` without the values that cannot be restored (each named in a log warning with
    ``source``, such as "the window settings"); {} when it is not a dict of values at all.

    Args:
        own: checks of the panel's own values, by name; the other names that are options of a
            run (`core.spec.names`) are checked as a run checks them, the rest left as they are
            (a panel ignores what it does not know).
    """
    if not isinstance(data, dict):
        log.warning("%s: not a set of values (%s): ignored, the defaults are used", source,
                    type(data).__name__)
        return {}
    own = own or {}
    out: dict[str, Any] = {}
    for key, value in data.items():
        problem = own[key](value) if key in own else _option_problem(key, value)
        if problem is None:
            out[key] = value
        else:
            log.warning("%s: %s %s cannot be restored (%s): its default is used", source, key,
                        _shown(value), problem)
    return out


def _option_problem(key: Any, value: Any, beside: Mapping[str, Any] | None = None
                    ) -> str | None:
    from ...core import spec
    from ...core.errors import UserError

    if not isinstance(key, str):
        return "not a name"
    if key not in spec.names():
        return None
    try:
        spec.from_options({**(beside or {}), key: value})
    except UserError as exc:
        return exc.words("window")
    return None


def texts(limit: int, longest: int = 4096) -> Check:
    """A check for a list of at most ``limit`` texts, each at most ``longest`` characters."""

    def check(value: Any) -> str | None:
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return "not a list of texts"
        if len(value) > limit or any(len(v) > longest for v in value):
            return f"more than {limit} texts, or one longer than {longest} characters"
        return None

    return check


def one_of(choices: tuple[str, ...]) -> Check:
    def check(value: Any) -> str | None:
        return None if isinstance(value, str) and value in choices else (
            f"not one of {', '.join(choices)}")

    return check


def as_option(name: str, convert: Callable[[Any], Any] = lambda v: v,
              beside: Mapping[str, Any] | None = None) -> Check:
    """A check of the run's option ``name`` as the panel keeps it: ``convert`` gives the run's
    form (a value it cannot convert is refused), ``beside`` the options it needs beside it (the
    placement's fields need a device map)."""

    def check(value: Any) -> str | None:
        try:
            converted = convert(value)
        except (TypeError, ValueError, AttributeError):
            return "not a value of this kind"
        return _option_problem(name, converted, beside)

    return check


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
