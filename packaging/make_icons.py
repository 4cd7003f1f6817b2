"""Draw the application icon (two overlapping panes and a patch) at every size we ship.

    QT_QPA_PLATFORM=offscreen python packaging/make_icons.py

Writes resources/icons/ctxpatch-{16,24,32,48,64,128,256,512}.png and ctxpatch.svg.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QBrush, QColor, QGuiApplication, QImage, QPainter, QPen
from PySide6.QtSvg import QSvgGenerator

OUT = Path(__file__).resolve().parents[1] / "resources" / "icons"
SIZES = (16, 24, 32, 48, 64, 128, 256, 512)


def draw(p: QPainter, s: float) -> None:
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(QBrush(QColor("#1e3a5f")))
    p.drawRoundedRect(QRectF(0, 0, s, s), s * 0.18, s * 0.18)
    pane = QPen(QColor("#e9eef7"), max(1.0, s * 0.045))
    p.setPen(pane)
    p.setBrush(QBrush(QColor("#2f6fb3")))
    p.drawRoundedRect(QRectF(s * 0.14, s * 0.2, s * 0.42, s * 0.56), s * 0.05, s * 0.05)
    p.setBrush(QBrush(QColor("#3d8bd9")))
    p.drawRoundedRect(QRectF(s * 0.44, s * 0.24, s * 0.42, s * 0.56), s * 0.05, s * 0.05)
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(QBrush(QColor("#ffd24a")))  # the patch
    p.drawRect(QRectF(s * 0.56, s * 0.42, s * 0.18, s * 0.18))


def main() -> None:
    app = QGuiApplication([])  # noqa: F841 - painting needs one
    OUT.mkdir(parents=True, exist_ok=True)
    for size in SIZES:
        image = QImage(size, size, QImage.Format.Format_ARGB32)
        image.fill(Qt.GlobalColor.transparent)
        painter = QPainter(image)
        draw(painter, float(size))
        painter.end()
        image.save(str(OUT / f"ctxpatch-{size}.png"))
    svg = QSvgGenerator()
    svg.setFileName(str(OUT / "ctxpatch.svg"))
    svg.setSize(QSize(256, 256))
    svg.setViewBox(QRectF(0, 0, 256, 256))
    svg.setTitle("ctxpatch")
    painter = QPainter(svg)
    draw(painter, 256.0)
    painter.end()


if __name__ == "__main__":
    main()
