"""Time from launch to a visible window, in fresh processes (prints figures; asserts nothing).

    python bench/startup.py [--runs 5]

Each run starts a new interpreter that imports the app, builds the main window, shows it and
processes events once; the figure is the wall time of the whole process, interpreter start
included, plus the in-process time to the shown window. It also reports whether torch or
transformers were imported on the way (they must not be: models load in the background).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

CHILD = """
import time; t0 = time.perf_counter()
import sys
from PySide6.QtWidgets import QApplication
from PySide6.QtCore import QSettings
from ctxpatch.app.main_window import MainWindow
app = QApplication(sys.argv[:1])
w = MainWindow(settings=QSettings(sys.argv[1], QSettings.Format.IniFormat), autoload=False)
w.show(); app.processEvents()
print(time.perf_counter() - t0, int("torch" in sys.modules), int("transformers" in sys.modules),
      flush=True)
import os; os._exit(0)  # skip interpreter teardown: only the start-up is measured
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    env = {**os.environ, "QT_QPA_PLATFORM": os.environ.get("QT_QPA_PLATFORM", "offscreen")}
    ini = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".startup-settings.ini")
    walls, inner = [], []
    for _ in range(args.runs):
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CHILD, ini], env=env, capture_output=True,
                             text=True, check=True).stdout.split()
        walls.append(time.perf_counter() - t)
        inner.append(float(out[0]))
        heavy = [name for name, flag in zip(("torch", "transformers"), out[1:3], strict=True)
                 if flag == "1"]
    if os.path.exists(ini):
        os.remove(ini)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, {platform.system()}")
    print(f"launch to visible window (whole process): median {statistics.median(walls):.2f} s "
          f"(min {min(walls):.2f}, max {max(walls):.2f}, {args.runs} runs)")
    print(f"imports + window build + show (in process): median {statistics.median(inner):.2f} s")
    print(f"heavy modules imported before the window showed: {', '.join(heavy) or 'none'}")


if __name__ == "__main__":
    main()
