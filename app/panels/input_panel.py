"""The input panel: context, an image (button or drag-and-drop), query, presets, how many
tokens, and the Run and Cancel buttons.

A picture is read and checked by core's reader, the one the run uses, so that what the run
would refuse is refused when it is dropped or chosen; the panel shows a thumbnail of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QDragEnterEvent, QDropEvent, QImage, QPixmap
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from ... import resources
from .. import dialogs


class QtInputPanel(QGroupBox):
    run_requested = Signal()
    cancel_requested = Signal()
    preset_chosen = Signal(dict)
    problem = Signal(str)  # a file dropped or chosen that cannot be used as an image

    IMAGE_FILTER = "Images (*.png *.jpg *.jpeg *.webp *.gif)"
    THUMB = 44

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Input", parent)
        self.presets = resources.presets()
        self.preset = QComboBox()
        self.preset.addItem("Presets…")
        self.preset.addItems([p["name"] for p in self.presets])
        self.context = QPlainTextEdit()
        self.context.setPlaceholderText("The context to absorb into the weights "
                                        "(empty with absorb 'all': the whole prompt is absorbed)")
        self.image_path = ""
        self.takes_images = True  # until a text-only model is loaded
        self.image_thumb = QLabel()
        self.image_thumb.setFixedSize(self.THUMB, self.THUMB)
        self.image_thumb.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.image_thumb.setFrameShape(QLabel.Shape.StyledPanel)
        self.image_label = QLabel()
        self.image_label.setWordWrap(True)
        self.image_button = QPushButton("Image…")
        self.image_button.setToolTip("Add a picture to the context (image+text models); or drop "
                                     "an image file on this panel (Ctrl+I)")
        self.image_clear = QToolButton()
        self.image_clear.setText("✕")
        self.image_clear.setToolTip("Remove the image from the context")
        self.setAcceptDrops(True)
        self.query = QPlainTextEdit()
        self.query.setPlaceholderText("The query the patched model sees")
        self.query.setMaximumHeight(90)
        for edit in (self.context, self.query):  # small screens: the edits give way first
            edit.setMinimumHeight(3 * self.fontMetrics().lineSpacing())
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 4096)
        self.max_tokens.setValue(20)
        self.chat_template = QCheckBox("Chat template")
        self.chat_template.setToolTip("Wrap context and query in the tokenizer's chat template")
        self.chat_template.setEnabled(False)
        self.run = QPushButton("Run")
        self.run.setToolTip("Run the comparison (Ctrl+Return)")
        self.run.setDefault(True)
        self.cancel = QPushButton("Cancel")
        self.cancel.setToolTip("Stop before the next layer or token (Esc)")
        self.cancel.setEnabled(False)
        layout = QVBoxLayout(self)
        layout.addWidget(self.preset)
        layout.addWidget(QLabel("Context"))
        layout.addWidget(self.context, 2)
        image_row = QHBoxLayout()
        image_row.addWidget(self.image_thumb)
        image_row.addWidget(self.image_label, 1)
        image_row.addWidget(self.image_button)
        image_row.addWidget(self.image_clear)
        layout.addLayout(image_row)
        layout.addWidget(QLabel("Query"))
        layout.addWidget(self.query, 1)
        form = QFormLayout()
        form.addRow("New tokens", self.max_tokens)
        form.addRow(self.chat_template)
        layout.addLayout(form)
        buttons = QHBoxLayout()
        buttons.addWidget(self.run, 1)
        buttons.addWidget(self.cancel)
        layout.addLayout(buttons)
        self.preset.activated.connect(self._on_preset)
        self.preset.setToolTip("The paper's prompts and two examples; the box names the preset "
                               "loaded until its context or query is edited")
        for edit in (self.context, self.query):
            edit.textChanged.connect(self._on_prompt_edited)
        self.run.clicked.connect(self.run_requested)
        self.cancel.clicked.connect(self.cancel_requested)
        self.image_button.clicked.connect(self.choose_image)
        self.image_clear.clicked.connect(lambda: self.set_image(""))
        self.set_image("")

    # -- the image ------------------------------------------------------------------------------
    def choose_image(self) -> None:
        path = dialogs.open_file(self, "image", "Context image", self.IMAGE_FILTER)
        if path:
            self.set_image(path)

    def set_takes_images(self, takes: bool) -> None:
        """Say whether the loaded model can read the image (the choice is kept either way)."""
        self.takes_images = takes
        if not self.image_path:
            self.set_image("")

    def set_image(self, path: str) -> bool:
        """Show ``path`` as the context image ("" removes it). A file the run would refuse is
        refused here, with the same line (`core.images.read_image`, the run's own reader: a
        pipe or a device before it is opened, a BMP, an SVG, a file that is not a picture), as
        `problem`; the current image is kept. Returns whether it was set."""
        if path:
            read = _read(path)
            if isinstance(read, str):
                self.problem.emit(read)
                return False
            picture, info = read
            self.image_thumb.setPixmap(_thumbnail(picture, self.THUMB))
            self.image_label.setText(f"{Path(path).name}\n{info.width}×{info.height}")
            self.image_label.setToolTip(path)
        else:
            self.image_thumb.clear()
            self.image_thumb.setText("no\nimage")
            self.image_label.setText(
                "Drop an image here" if self.takes_images else
                "Drop an image here (needs an image+text model; this one reads text only)")
            self.image_label.setToolTip("")
        self.image_path = path
        self.image_clear.setEnabled(bool(path))
        return True

    def image_problem(self) -> str | None:
        """Why the chosen image cannot be used now (it may have changed since it was chosen),
        as `set_image` says it; None when there is none or it reads."""
        read = _read(self.image_path) if self.image_path else None
        return read if isinstance(read, str) else None

    def dragEnterEvent(self, event: QDragEnterEvent) -> None:  # noqa: N802 - Qt's name
        urls = event.mimeData().urls()
        if urls and urls[0].isLocalFile():
            event.acceptProposedAction()

    def dropEvent(self, event: QDropEvent) -> None:  # noqa: N802 - Qt's name
        urls = event.mimeData().urls()
        if urls and urls[0].isLocalFile():
            self.set_image(urls[0].toLocalFile())
            event.acceptProposedAction()

    def _on_preset(self, index: int) -> None:
        if index <= 0:
            return
        preset = self.presets[index - 1]
        self.context.setPlainText(preset.get("context", ""))
        self.query.setPlainText(preset.get("query", ""))
        self.set_image(resources.sample_image_path() if preset.get("image") == "sample" else "")
        if "chat_template" in preset and self.chat_template.isEnabled():
            self.chat_template.setChecked(bool(preset["chat_template"]))
        self.preset.setCurrentIndex(index)  # (named until the prompt is edited)
        self.preset_chosen.emit(preset)

    def choose_preset(self, i: int) -> None:
        """Load preset ``i`` (0-based) as if chosen in the box."""
        self._on_preset(i + 1)

    def _on_prompt_edited(self) -> None:
        index = self.preset.currentIndex()
        if index <= 0:
            return
        preset = self.presets[index - 1]
        if (self.context.toPlainText() != preset.get("context", "")
                or self.query.toPlainText() != preset.get("query", "")):
            self.preset.setCurrentIndex(0)  # no longer that preset

    def set_busy(self, busy: bool) -> None:
        self.run.setEnabled(not busy)
        self.cancel.setEnabled(busy)

    def set_chat_template_available(self, available: bool) -> None:
        self.chat_template.setEnabled(available)
        if not available:
            self.chat_template.setChecked(False)

    def values(self) -> dict[str, Any]:
        return {
            "context": self.context.toPlainText(),
            "query": self.query.toPlainText(),
            "max_new_tokens": self.max_tokens.value(),
            "chat_template": self.chat_template.isChecked() and self.chat_template.isEnabled(),
            "image": self.image_path,
        }

    def save(self) -> dict[str, Any]:
        return {**self.values(), "chat_template": self.chat_template.isChecked()}

    def restore(self, data: dict[str, Any], source: str = "the restored inputs") -> None:
        """Set the inputs from ``data`` (`save`'s keys); a value of the wrong type or an absurd
        size is left out with a warning in the log naming ``source``
        (`app.panels.values.checked`)."""
        from .values import checked

        data = checked(data, source)
        if "context" in data:
            self.context.setPlainText(str(data["context"]))
        if "query" in data:
            self.query.setPlainText(str(data["query"]))
        if data.get("max_new_tokens"):
            self.max_tokens.setValue(int(data["max_new_tokens"]))
        self.chat_template.setChecked(bool(data.get("chat_template")))
        if "image" in data:
            image = str(data["image"] or "")
            if not image or Path(image).is_file():
                self.set_image(image)


def _read(path: str) -> tuple[Any, Any] | str:
    """The picture and its `core.images.ImageInfo`, or the one line saying why the run would
    refuse it."""
    from ...core.errors import UserError
    from ...core.images import read_image

    try:
        return read_image(path)
    except UserError as exc:
        return exc.words("window")


def _thumbnail(picture: Any, size: int) -> QPixmap:
    """A Pillow RGB picture (`core.images.read_image`) as a pixmap at most ``size`` square."""
    small = picture.copy()
    small.thumbnail((size, size))
    data = small.tobytes("raw", "RGB")
    image = QImage(data, small.width, small.height, 3 * small.width, QImage.Format.Format_RGB888)
    return QPixmap.fromImage(image.copy())  # (copied: the bytes are Python's)
