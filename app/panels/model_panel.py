"""The model panel: which model, at which precision and where, and how the run patches it."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QWidget,
)

from ...core.options import ABSORB_MODES as ABSORB
from ...core.options import DEVICE_MAPS, DEVICES, DTYPES, METHODS, ON_FAULT, SCOPES
from .. import dialogs
from .values import Check, as_option, checked, texts

PLACEMENTS = ("one device", *DEVICE_MAPS)
ABLATIONS = ("input and output", "no input patches", "no output patches (frozen)")
DISABLED = {ABLATIONS[0]: [], ABLATIONS[1]: ["input"], ABLATIONS[2]: ["output"]}
TIPS = {
    "method": "direct: Theorem 1's controls. stable: Appendix B, most of the output correction "
              "in the down matrix, the rest in the norm scale.",
    "absorb": "context: absorb the context segments (template and query stay). "
              "all: absorb everything before the current token (the paper's protocol).",
    "scope": "all-positions: patches act on every reduced position (the literal theorem). "
             "query: on the current position only (faster; exact at the query).",
    "layers": "Which layers are patched: all, a start like 10:, a range 2:8 or a list 0,5,17. "
              "The first patched layer absorbs all upstream mismatch.",
}
#: the analyses the window offers (`RunSpec.analyze`), each a checkbox: name -> label, tip
ANALYSES = {
    "lens": ("Lens", "The context lens: what each layer's context effect writes into the "
             "vocabulary (the Context lens tab; one more reduced pass per token)"),
    "geometry": ("Geometry", "Patch geometry: how the patches align across tokens and layers, "
                 "and their rank (the Geometry tab; keeps every token's patch vectors)"),
    "transfer": ("Transfer", "Transfer: each token's patches applied at every other token, "
                 "the retained effect R (the Transfer tab; T batched passes after the run, "
                 "T the tokens; keeps every token's patch vectors; with a Gemma-style model "
                 "use method stable)"),
}


#: the most models the recent list keeps
MAX_RECENT = 10


def _memory(value: Any) -> tuple[str, ...] | None:
    """Max memory as the panel keeps it (typed text, or a session's list) in the run's form."""
    if value is None or isinstance(value, list):
        return None if value is None else tuple(value)
    return tuple(value.split()) or None


def _placement(value: Any) -> str | None:
    return None if value is None or value in PLACEMENTS else (
        f"not one of {', '.join(PLACEMENTS)}")


#: the panel's own values in what it restores, and their checks (`app.panels.values.checked`)
OWN: dict[str, Check] = {
    "recent": texts(MAX_RECENT),
    "device_map": _placement,
    "max_memory": as_option("max_memory", _memory, beside={"device_map": "auto"}),
    "offload_folder": as_option("offload_folder", beside={"device_map": "auto"}),
    "disable": as_option("disabled"),  # (what 0.1 wrote for disabled)
}


def _combo(items: tuple[str, ...], editable: bool = False) -> QComboBox:
    box = QComboBox()
    box.addItems(list(items))
    box.setEditable(editable)
    return box


class QtModelPanel(QGroupBox):
    load_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Model", parent)
        self.model = QComboBox()
        self.model.setEditable(True)
        self.model.setToolTip("'demo' (Gemma 3 270M), a Hugging Face hub id, or a local folder")
        self.model.lineEdit().setPlaceholderText("demo, a hub id or a folder")
        self.browse = QPushButton("Browse…")
        self.browse.setToolTip("Open a local model folder (Ctrl+O)")
        self.load = QPushButton("Load")
        self.load.setToolTip("Load the model now (Run also loads it when needed)")
        row = QHBoxLayout()
        row.addWidget(self.model, 1)
        row.addWidget(self.browse)
        row.addWidget(self.load)
        self.dtype = _combo(DTYPES)
        self.device = _combo(DEVICES, editable=True)
        self.placement = _combo(PLACEMENTS)
        self.placement.setToolTip("One device, or accelerate's placement across GPUs, CPU memory "
                                  "and disk for models larger than one device")
        self.max_memory = QLineEdit()
        self.max_memory.setPlaceholderText("max memory: 0=20GiB cpu=32GiB")
        self.max_memory.setToolTip("Memory per device for the placement (DEVICE=SIZE ...)")
        self.offload_folder = QLineEdit()
        self.offload_folder.setPlaceholderText("folder for layers that go to disk (optional)")
        self.footprint = QLabel()
        self.footprint.setWordWrap(True)
        self.loaded_label = QLabel("not loaded")
        self.loaded_label.setWordWrap(True)
        # two lines, always shown whole (the form gave a wrapped label one line's height)
        self.loaded_label.setMinimumHeight(2 * self.fontMetrics().lineSpacing() + 2)
        self.method = _combo(METHODS)
        self.absorb = _combo(ABSORB)
        self.scope = _combo(SCOPES)
        self.layers = QLineEdit("all")
        self.trust = QCheckBox("Trust its code")
        self.trust.setToolTip("Run Python code shipped with the checkpoint (trust_remote_code). "
                              "Only for models whose authors you trust: it can do anything.")
        self.pickle = QCheckBox("Allow pickles")
        self.pickle.setToolTip("Accept pytorch_model.bin when there are no safetensors (loaded "
                               "weights-only). A pickle can run code: only for models you trust.")
        self.patches = _combo(ABLATIONS)
        self.patches.setToolTip("Leave out a kind of patch (ablation). Without output patches "
                                "the output control is frozen; the controllability tab shows "
                                "where the attention shift exceeds what is then reachable.")
        self.on_fault = QCheckBox("Continue past NaN")
        self.on_fault.setToolTip("A NaN or infinity in the logits or the patches stops the run at "
                                 "that token and layer; ticked, the run continues and records "
                                 "it (on_fault 'continue')")
        self.output_control = _combo(("default",))
        self.output_control.setToolTip("The output control that absorbs the attention's shift "
                                "(default: the paper's choice for the family)")
        for name in ("method", "absorb", "scope", "layers"):
            getattr(self, name).setToolTip(TIPS[name])
        self.analyses: dict[str, QCheckBox] = {}
        for name, (label, tip) in ANALYSES.items():
            box = self.analyses[name] = QCheckBox(label)
            box.setToolTip(tip)
        form = QFormLayout(self)
        form.addRow(row)
        where = QHBoxLayout()
        where.addWidget(self.dtype, 1)
        where.addWidget(QLabel("on"))
        where.addWidget(self.device, 1)
        form.addRow("Precision", where)
        spread = QHBoxLayout()
        spread.addWidget(self.placement)
        spread.addWidget(self.max_memory, 1)
        form.addRow("Placement", spread)
        form.addRow("Offload to", self.offload_folder)
        form.addRow("Memory", self.footprint)
        trust = QHBoxLayout()
        trust.addWidget(self.trust)
        trust.addWidget(self.pickle)
        trust.addStretch(1)
        form.addRow(trust)
        form.addRow("Loaded", self.loaded_label)
        form.addRow("Method", self.method)
        form.addRow("Absorb", self.absorb)
        form.addRow("Scope", self.scope)
        form.addRow("Layers", self.layers)
        form.addRow("Output control", self.output_control)
        form.addRow("Patches", self.patches)
        analyses = QHBoxLayout()  # (one row with the NaN switch: the left column is full)
        for box in self.analyses.values():
            analyses.addWidget(box)
        analyses.addStretch(1)
        analyses.addWidget(self.on_fault)
        form.addRow("Analyses", analyses)
        two_lines = 2 * self.fontMetrics().lineSpacing() + 8
        for label in (self.footprint, self.loaded_label):  # wrapped text is not clipped
            label.setMinimumHeight(two_lines)
        self.browse.clicked.connect(self.browse_folder)
        self.load.clicked.connect(self.load_requested)
        self.model.currentTextChanged.connect(self._on_model_edited)
        self.dtype.currentTextChanged.connect(self._on_model_edited)
        self.placement.currentTextChanged.connect(self._on_placement)
        self._on_model_edited()
        self._on_placement()

    def _on_placement(self, *_: Any) -> None:
        spread = self.placement.currentText() != PLACEMENTS[0]
        self.max_memory.setEnabled(spread)
        self.offload_folder.setEnabled(spread)
        self.device.setEnabled(not spread)

    def browse_folder(self) -> None:
        folder = dialogs.open_folder(self, "model", "Open a model folder")
        if folder:
            self.model.setCurrentText(folder)

    def spec(self) -> str:
        return self.model.currentText().strip() or "demo"

    def key(self) -> tuple[str, str, str, tuple[str, str, str]]:
        """What decides a load: spec, dtype, device and the placement fields."""
        spread = self.placement.currentText() != PLACEMENTS[0]
        placement = ((self.placement.currentText(), self.max_memory.text().strip(),
                      self.offload_folder.text().strip()) if spread else (PLACEMENTS[0], "", ""))
        return (self.spec(), self.dtype.currentText(), self.device.currentText().strip() or "auto",
                placement)

    def trust_flags(self) -> dict[str, bool]:
        """Per load, never saved: trusting code or pickles is a decision for each model."""
        return {"trust_remote_code": self.trust.isChecked(),
                "allow_pickle": self.pickle.isChecked()}

    def _on_model_edited(self, *_: Any) -> None:
        from ...core.footprint import estimate

        fp = estimate(self.spec(), self.dtype.currentText())
        self.footprint.setText(footprint_text(fp) if fp else "unknown until loaded")

    def remember(self, spec: str, limit: int = MAX_RECENT) -> None:
        """Put a successfully loaded model first in the recent list."""
        items = [self.model.itemText(i) for i in range(self.model.count())]
        items = [spec] + [s for s in items if s != spec]
        self.model.blockSignals(True)
        self.model.clear()
        self.model.addItems(items[:limit])
        self.model.setCurrentText(spec)
        self.model.blockSignals(False)

    def recent(self) -> list[str]:
        return [self.model.itemText(i) for i in range(self.model.count())]

    def set_controls(self, controls: tuple[str, ...]) -> None:
        current = self.output_control.currentText()
        self.output_control.clear()
        self.output_control.addItems(["default", *controls])
        if current in controls:
            self.output_control.setCurrentText(current)

    def set_loaded(self, text: str) -> None:
        self.loaded_label.setText(text)

    def options(self) -> dict[str, Any]:
        control = self.output_control.currentText()
        return {
            "method": self.method.currentText(),
            "absorb": self.absorb.currentText(),
            "scope": self.scope.currentText(),
            "layers": self.layers.text().strip() or "all",
            "output_control": None if control == "default" else control,
            "disabled": DISABLED[self.patches.currentText()],
            "on_fault": "continue" if self.on_fault.isChecked() else "stop",
            "analyze": [name for name, box in self.analyses.items() if box.isChecked()],
        }

    def spec_options(self) -> dict[str, Any]:
        """The run's options of this panel by `core.spec.RunSpec` name: the model as `key`
        loads it, its trust flags, and how the run patches it."""
        model, dtype, device, (placement, memory, folder) = self.key()
        spread = placement != PLACEMENTS[0]
        return {"model": model, "dtype": dtype, "device": device,
                "device_map": placement if spread else None,
                "max_memory": tuple(memory.split()) if spread and memory else None,
                "offload_folder": folder if spread and folder else None,
                **self.trust_flags(), **self.options()}

    def save(self) -> dict[str, Any]:
        return {"model": self.spec(), "recent": self.recent(), "dtype": self.dtype.currentText(),
                "device": self.device.currentText(), "device_map": self.placement.currentText(),
                "max_memory": self.max_memory.text(), "offload_folder": self.offload_folder.text(),
                **self.options()}

    def restore(self, data: dict[str, Any], source: str = "the restored options") -> None:
        """Set the controls from ``data`` (`save`'s keys, or the run's options by name); a value
        of the wrong type or an absurd size is left out with a warning in the log naming
        ``source`` (`app.panels.values.checked`), its control unchanged or at its default."""
        data = checked(data, source, OWN)
        recent = [str(s) for s in (data.get("recent") or []) if s]
        self.model.blockSignals(True)
        self.model.clear()
        self.model.addItems(recent or ["demo"])
        self.model.setCurrentText(str(data.get("model") or "demo"))
        self.model.blockSignals(False)
        for name in ("dtype", "device", "method", "absorb", "scope"):
            value = data.get(name)
            box: QComboBox = getattr(self, name)
            if value and (box.isEditable() or box.findText(str(value)) >= 0):
                box.setCurrentText(str(value))
        disabled = sorted(data.get("disable") or data.get("disabled") or [])
        for text, kinds in DISABLED.items():
            if kinds == disabled:
                self.patches.setCurrentText(text)
        if data.get("layers"):
            self.layers.setText(str(data["layers"]))
        if "analyze" in data:  # (checked by `checked` as the run checks it)
            chosen = set(data["analyze"])
            for name, box in self.analyses.items():
                box.setChecked(name in chosen)
        if data.get("on_fault") in ON_FAULT:
            self.on_fault.setChecked(data["on_fault"] == "continue")
        if data.get("device_map") in PLACEMENTS:
            self.placement.setCurrentText(str(data["device_map"]))
        memory = data.get("max_memory")
        if memory is not None:
            self.max_memory.setText(" ".join(memory) if isinstance(memory, list) else str(memory))
        if data.get("offload_folder") is not None:
            self.offload_folder.setText(str(data["offload_folder"]))
        # given on the command line for this start only (save() never records them)
        if data.get("trust_remote_code"):
            self.trust.setChecked(True)
        if data.get("allow_pickle"):
            self.pickle.setChecked(True)
        self._on_model_edited()


def parameter_count(n: int) -> str:
    """A parameter count to read at a glance: "0.3 M", "4.2 M", "135 M", "1.2 B"; a count under
    ten thousand as it is ("3,200"), never "0 M"."""
    if n < 10_000:
        return f"{n:,}"
    if n < 1e9:
        m = n / 1e6
        return f"{m:.2g} M" if m < 10 else f"{m:,.0f} M"
    b = n / 1e9
    return f"{b:.2g} B" if b < 10 else f"{b:,.0f} B"


def footprint_text(fp: Any) -> str:
    """The memory estimate (`core.footprint.Footprint`) with a parameter count that reads well
    for small models too (0.3 M, not "0 M")."""
    from ...core.footprint import _human

    cache = fp.run_cache_bytes()
    kv = f" + {_human(cache)} of KV caches per 1,000 tokens" if cache else ""
    return (f"≈ {_human(fp.bytes)} in {fp.dtype} ({parameter_count(fp.parameters)} parameters)"
            f"{kv}, plus activations")
