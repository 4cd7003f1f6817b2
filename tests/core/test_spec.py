"""Issue 31: every run option is one field of `core.spec.RunSpec`, and the command line, the
Python API and the session schema are derived from it; ``on_fault`` is reachable from each; the
library never imports the window."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ctxpatch.app.cli import main
from ctxpatch.core import spec as specs
from ctxpatch.core.errors import UserError
from ctxpatch.core.spec import RunSpec, _opt
from tiny import llama_config, save_tiny_folder, tiny_config, tiny_loaded

import ctxpatch

QUERY = "Where does Alice live?"


@dataclasses.dataclass(frozen=True)
class Extended(RunSpec):
    """RunSpec with one more option, as a developer adds one."""

    lens_depth: int = _opt(3, "how many layers the lens of this test looks through", "run")


@pytest.fixture
def extended(monkeypatch: pytest.MonkeyPatch) -> type[RunSpec]:
    monkeypatch.setattr(specs, "RunSpec", Extended)
    return Extended


def _help(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--help"]) == 0
    return " ".join(out.getvalue().split())


def test_a_new_field_is_a_flag_with_its_help(extended: type[RunSpec]) -> None:
    text = _help("compare")
    assert "--lens-depth LENS_DEPTH how many layers the lens of this test looks through" in text
    assert "--lens-depth" in _help("bench")
    assert "--lens-depth" not in _help("verify")  # (verify takes the model's options alone)


def test_a_new_field_is_an_api_option_and_reaches_the_record(extended: type[RunSpec]) -> None:
    loaded = tiny_loaded(tiny_config("llama"))
    run = ctxpatch.compare(loaded, context="Alice lives in Paris.", query=QUERY,
                           max_new_tokens=1, lens_depth=4)
    assert run.record["settings"]["lens_depth"] == 4 and run.spec.lens_depth == 4
    with pytest.raises(ctxpatch.OptionError, match="option lens_depth must be a whole number"):
        ctxpatch.compare(loaded, context="c", query=QUERY, lens_depth="4")


def test_a_new_field_is_in_the_session_schema(extended: type[RunSpec], tmp_path: Path) -> None:
    from ctxpatch.app.session import SessionError, load_session, session_dict

    loaded = tiny_loaded(tiny_config("llama"))
    record = ctxpatch.compare(loaded, context="Alice lives in Paris.", query=QUERY,
                              max_new_tokens=1).to_dict()
    path = tmp_path / "s.json"
    path.write_text(json.dumps(session_dict({}, {}, [record], 0)))
    assert load_session(path)["runs"][0]["settings"]["lens_depth"] == 3
    record["settings"]["lens_depth"] = "deep"
    path.write_text(json.dumps(session_dict({}, {}, [record], 0)))
    with pytest.raises(SessionError, match=r"runs\[0\]\.settings\.lens_depth"):
        load_session(path)


def test_one_validation_for_every_front_end() -> None:
    for bad, message in ((dict(context=5), "option context must be a text, not 5"),
                         (dict(query=None), "option query must be a text, not None"),
                         (dict(max_new_tokens="5"), "must be a whole number, not '5'"),
                         (dict(max_new_tokens=2.5), "must be a whole number, not 2.5"),
                         (dict(layers=5), "option layers must be a text"),
                         (dict(top_k=None), "option top_k must be a whole number"),
                         (dict(on_fault="ignore"), "unknown on fault 'ignore': use one of stop"),
                         (dict(method="fast"), "unknown method 'fast'"),
                         (dict(disabled=["both"]),
                          "option disabled: unknown 'both': use one or more"),
                         (dict(query="a\udc80b"), "query is not valid text"),
                         (dict(nonsense=1), "unknown option 'nonsense'")):
        with pytest.raises(UserError, match=message):
            specs.from_options(bad)
        with pytest.raises(ctxpatch.OptionError, match=message):  # before any model loads
            ctxpatch.compare("no-such-model", **{"context": "c", "query": "q", **bad})


def test_the_defaults_are_the_command_line_s() -> None:
    from ctxpatch.app.cli import build_parser

    args = build_parser().parse_args(["compare"])
    assert specs.from_namespace(args) == RunSpec()
    args = build_parser().parse_args(["compare", "--no-control", "--disable", "input",
                                      "--max-memory", "0=1GiB", "--device-map", "auto"])
    chosen = specs.from_namespace(args)
    assert not chosen.control and chosen.disabled == frozenset({"input"})
    assert chosen.max_memory == ("0=1GiB",)


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny model whose float16 run overflows at its first token."""
    folder = Path(save_tiny_folder(tmp_path_factory.mktemp("fault"), llama_config(layers=2)))
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.down_proj.weight"] *= 1e7  # float16 tops out at 65504
    save_file(tensors, weights, metadata={"format": "pt"})
    return folder


def test_on_fault_continue_from_the_command_line(overflowing: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", "--model", str(overflowing), "--dtype", "float16", "--context",
            "Alice lives in Paris.", "--query", QUERY, "--max-new-tokens", "2", "--quiet"]
    assert main(argv) == 2
    assert "numerical fault at token 1" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert main([*argv, "--on-fault", "continue", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["settings"]["on_fault"] == "continue" and len(record["steps"]) == 2
    assert record["steps"][0]["logit_scale"] is None  # (a NaN or infinity, as JSON has none)


def test_on_fault_continue_from_the_api(overflowing: Path) -> None:
    with pytest.raises(ctxpatch.OptionError, match="numerical fault at token 1"):
        ctxpatch.compare(str(overflowing), dtype="float16", context="Alice lives in Paris.",
                         query=QUERY, max_new_tokens=2)
    run = ctxpatch.compare(str(overflowing), dtype="float16", context="Alice lives in Paris.",
                           query=QUERY, max_new_tokens=2, on_fault="continue")
    assert len(run.steps) == 2 and not torch.isfinite(torch.tensor(run.steps[0].logit_scale))


def test_the_library_never_imports_the_window(tmp_path: Path) -> None:
    """`import ctxpatch` and a whole comparison load no ``ctxpatch.app`` module (nor Qt)."""
    folder = save_tiny_folder(tmp_path / "m", llama_config(layers=2))
    code = f"""
import sys
import ctxpatch
assert not [m for m in sys.modules if m.startswith(("ctxpatch.app", "PySide6"))], "import"
run = ctxpatch.compare({str(folder)!r}, context="Alice lives in Paris.", query="Where?",
                       max_new_tokens=2, verify=True)
run.to_json({str(tmp_path / "r.json")!r})
assert run.record["verification"]["ok"]
loaded = [m for m in sys.modules if m.startswith(("ctxpatch.app", "PySide6"))]
assert not loaded, loaded
print("clean")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "clean", done.stderr[-2000:]


def test_a_run_is_planned_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`RunPlan.build` decides the layers, sites and output plans once per run, for the run,
    its resolved control row and its controllability report (it was three times)."""
    from ctxpatch.core import plan as plans

    calls: list[int] = []
    real = plans.plan_patching

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(plans, "plan_patching", counted)
    folder = save_tiny_folder(tmp_path / "m", llama_config(layers=2))
    assert main(["compare", "--model", str(folder), "--absorb", "all", "--query", QUERY,
                 "--max-new-tokens", "2", "--quiet"]) == 0
    assert len(calls) == 1
    ctxpatch.compare(tiny_loaded(tiny_config("llama")), context="c", query=QUERY,
                     max_new_tokens=2)
    assert len(calls) == 2


@pytest.mark.parametrize("family, options, strategy", [
    ("llama", dict(absorb="all"), "one pass"),
    ("llama", dict(absorb="all", control_row="separate"), "separate passes"),
    ("llama", dict(absorb="all", keep_bos=True), "batched control"),
    ("llama", dict(absorb="context", scope="query"), "cached query"),
    ("llama", dict(absorb="context"), "separate passes"),
    ("mixtral", dict(absorb="all"), "separate passes"),
])
def test_the_plan_names_one_strategy(family: str, options: dict[str, str], strategy: str) -> None:
    from ctxpatch.core.plan import RunPlan
    from ctxpatch.core.prompt import build_prompt

    loaded = tiny_loaded(tiny_config(family))
    run = RunSpec(max_new_tokens=1, **options)
    prompt = build_prompt(loaded.tokenizer, "" if run.absorb == "all" else "Alice.", QUERY)
    assert RunPlan.build(loaded, prompt, run).strategy == strategy


def test_messages_name_options_as_each_front_end_does(tmp_path: Path) -> None:
    """Core names an option once (`mention`); the command line says the flag, Python the
    keyword, the window its control."""
    from ctxpatch.core.errors import mention

    e = UserError(f"pass {mention('allow_pickle')}; use {mention('device', 'cpu')}; "
                  f"{mention('control', False)}; give {mention('image', metavar='FILE')}")
    assert str(e) == "pass allow_pickle=True; use device='cpu'; control=False; give image=..."
    assert e.words("cli") == ("pass --allow-pickle; use --device cpu; --no-control; "
                              "give --image FILE")
    assert e.words("window").startswith("pass 'Allow pickles'; use 'Device': cpu")
    # a real refusal through both front ends: pickled weights only
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ctxpatch.OptionError) as info:
        ctxpatch.compare(str(folder), context="a", query="b")
    assert "allow_pickle=True" in str(info.value) and "--allow-pickle" not in str(info.value)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["compare", "--model", str(folder), "--context", "a", "--query", "b"]) == 2
    assert "--allow-pickle" in err.getvalue() and "allow_pickle=True" not in err.getvalue()
