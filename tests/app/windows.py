"""The window tests' two moves: open a window on a model with inputs typed, and run it to the
end (the outcome: "completed", "cancelled" or "failed")."""

from __future__ import annotations

from typing import Any


def open_window(keep: Any, settings: Any, model: str, context: str = "", query: str = "",
                tokens: int = 4) -> Any:
    from ctxpatch.app.main_window import MainWindow

    w = MainWindow(model=model, settings=settings, autoload=False)
    keep(w)
    w.input_panel.context.setPlainText(context)
    w.input_panel.query.setPlainText(query)
    # (a fresh profile starts on the paper's absorb all; with a context, test absorbing it)
    w.model_panel.absorb.setCurrentText("context" if context else "all")
    w.input_panel.max_tokens.setValue(tokens)
    w.show()
    return w


def run_to_end(qtbot: Any, w: Any, timeout: int = 60_000) -> str:
    with qtbot.waitSignal(w.run_finished, timeout=timeout) as blocker:
        w.start_run()
    return str(blocker.args[0])
