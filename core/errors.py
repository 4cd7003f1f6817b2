"""Errors that cross the core/app boundary.

`UserError` is anything the person at the keyboard can fix (a bad path, an unsupported model,
a malformed option). The command line prints its message as one line and exits with status 2;
the window shows it and keeps working. Everything else is an internal failure.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input, reported as one clear line."""


class Cancelled(Exception):
    """Raised inside a run when `should_stop()` answered True; never reaches the user."""
