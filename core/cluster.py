"""Prompt sets on a Ray cluster (``ctxpatch reproduce --ray auto|ADDRESS``).

One actor per GPU of the cluster (or, without GPUs, per CPU slot) loads the model once per
dtype and runs the (prompt, setting) jobs it is handed, one at a time; each record streams back
to the driver, which checks and writes it (`core.experiments.save_record`) the moment it
arrives, so the driver's folder is the only one written. An actor that dies has its job handed
to another (a new actor takes its place while the cluster has room); Ctrl+C (or
``should_stop``) cancels the jobs in flight, ends the actors and keeps every record already
written. Ray is an optional extra (``pip install "ctxpatch[cluster]"``), imported here only.
"""

from __future__ import annotations

import importlib.util

from .errors import UserError

INSTALL = 'pip install "ctxpatch[cluster]"'


def check_ray(address: str) -> None:
    """``--ray``'s value and Ray itself, before any run.

    Raises:
        UserError: Ray is not installed (one line: what to install), or an empty address.
    """
    if not address.strip():
        raise UserError("--ray needs auto or a cluster's address (host:port of ray start --head)")
    if importlib.util.find_spec("ray") is None:
        raise UserError(f"--ray needs Ray, which is not installed: {INSTALL}")
