"""The values of every run option, once, torch-free (the command line, the window, the Python
API, sessions and the engine all read them here). ``Literal`` types name them for type
checkers; the tuples are what menus list and validation checks, the first the default."""

from __future__ import annotations

from typing import Literal, get_args

Dtype = Literal["float32", "bfloat16", "float16", "float64"]
Method = Literal["direct", "stable"]
Absorb = Literal["context", "all"]
Scope = Literal["all-positions", "query"]
PatchKind = Literal["input", "output"]
OutputControl = Literal["scale", "matrix", "bias", "experts"]
DeviceMap = Literal["auto", "balanced", "sequential"]
OnFault = Literal["stop", "continue"]
ControlRow = Literal["auto", "batched", "separate"]
#: the analyses a comparison may add to its record (../shared/ANALYSIS.md A1, A2, A3)
Analysis = Literal["lens", "geometry", "transfer"]

DTYPES: tuple[str, ...] = get_args(Dtype)
METHODS: tuple[str, ...] = get_args(Method)
ABSORB_MODES: tuple[str, ...] = get_args(Absorb)
SCOPES: tuple[str, ...] = get_args(Scope)
PATCH_KINDS: tuple[str, ...] = get_args(PatchKind)
OUTPUT_CONTROLS: tuple[str, ...] = get_args(OutputControl)
DEVICE_MAPS: tuple[str, ...] = get_args(DeviceMap)
ON_FAULT: tuple[str, ...] = get_args(OnFault)
CONTROL_ROWS: tuple[str, ...] = get_args(ControlRow)
ANALYSES: tuple[str, ...] = get_args(Analysis)
DEVICES = ("auto", "cpu", "cuda", "mps")  # (and cuda:N)
