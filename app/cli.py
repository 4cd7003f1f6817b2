"""The ``ctxpatch`` command line (DESIGN.md "Command line contract").

Exit status: 0 success; 2 a user error, printed as one line on stderr; 1 an internal failure
(or a verification that did not reproduce the logits). Progress goes to stderr, requested
output only to stdout. Qt is imported only to open the window.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ..core import __version__, spec
from ..core.errors import UserError
from ..core.options import DTYPES
from ..core.outputs import STDOUT, check_outputs, check_report, run_inputs

EXAMPLES_COMPARE = """examples:
  ctxpatch compare --absorb all --query "Write a single-sentence weather forecast for Mars, \\
      from the perspective of a slightly annoyed robot:" --json mars.json
  ctxpatch compare --context "Alice lives in Paris." --query "Where does Alice live?" \\
      --method stable --dtype bfloat16 --save-patches p.safetensors
  ctxpatch compare --model google/gemma-3-4b-it --chat-template --image cat.png \\
      --query "Describe this image in 10 words." --report cat.html
"""
EXAMPLES_BENCH = """examples:
  ctxpatch bench --absorb all --query "Write a single-sentence weather forecast for Mars, from \\
      the perspective of a slightly annoyed robot:" --repeats 5 --json bench.json
  ctxpatch bench --context "Alice lives in Paris." --query "Where?" --scope query --no-memory
  ctxpatch bench --absorb all --query "Hi" --load 2 --no-memory   # two busy processes beside
"""
EXAMPLES_REPRODUCE = """examples:
  ctxpatch reproduce                       # the demo model, into ./ctxpatch-reproduction
  ctxpatch reproduce --model smollm2 --out smol --prompts 2 --sweep 0,15,29
  ctxpatch reproduce --prompts demo-set --out demo-set --dtypes bfloat16 --sweep none
  ctxpatch reproduce --prompts my-set.jsonl --absorb all,context --layers all --layers 10: \\
      --out my-set --ray auto            # rows: {"id", "context", "query", "image"}
"""
EXAMPLES_DYNAMICS = """examples:
  ctxpatch dynamics --context "Zorblat is a small village in the mountains. It is famous for \\
      its purple cheese." --query "Zorblat is famous for its" --json zorblat.json
  ctxpatch dynamics --context "France: Paris. Japan: Tokyo. Italy: Rome." --query "Kenya:"
"""
EXAMPLES_COMPILE = """examples:
  ctxpatch compile --context "Alice moved to Lisbon in 2019 and works there as a marine \\
      biologist." --query "Where does Alice live?" --query "When did Alice move?" \\
      --held-out "What city is Alice in?" --rank 8 --adapter alice-lora --json alice.json
  ctxpatch compile --model smollm2 --context "Alice moved to Lisbon in 2019." --query \
      "Where does Alice live?" --held-out "What city is Alice in?" --sweep 1,2,4,8,16 \
      --report alice.html
"""
EXAMPLES_VERIFY = """examples:
  ctxpatch verify p.safetensors
  ctxpatch verify p.safetensors --model ./my-model --dtype float64
"""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad option as one line and exit status 2; with
    ``families_in_help`` its help ends with the supported families (`core.family_names`: the
    registry's line without importing torch, so that the help takes a fraction of a second)."""

    families_in_help = False

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"ctxpatch: error: {message} (see {self.prog} --help)\n")

    def format_help(self) -> str:
        if not self.families_in_help:
            return super().format_help()
        import textwrap

        from ..core.family_names import FAMILIES

        families = textwrap.fill("supported families (model types): " + FAMILIES,
                                 width=100, subsequent_indent="  ", break_on_hyphens=False)
        return super().format_help() + "\n" + families + "\n"


#: the options that choose and place the model (verify and reproduce take these alone)
MODEL_OPTIONS = ("model", "dtype", "device", "trust_remote_code", "allow_pickle", "device_map",
                 "max_memory", "offload_folder")


def _model_options(p: argparse.ArgumentParser, from_patches: bool = False) -> None:
    """The model's options; ``from_patches``: verify's, whose model and dtype default to the
    ones the patches file names."""
    spec.add_arguments(p, MODEL_OPTIONS, defaults={"model": None, "dtype": None}
                       if from_patches else None)
    if from_patches:
        for action in p._actions:
            if action.dest == "dtype":
                action.help = ("precision of the weights and of the run (default: the one the "
                               "patches were made in)")
            elif action.dest == "model":
                action.help = (action.help or "").replace(", the default)", ")") + (
                    " (default: the one the patches were made with)")


def _compare_options(p: argparse.ArgumentParser | Any, grouped: bool = True,
                     outputs: bool = True) -> None:
    """Every run option (from `core.spec.RunSpec`), then the outputs: compare's files, or
    (``outputs`` False: bench) the JSON alone."""
    spec.add_arguments(p, grouped=grouped)
    out = p.add_argument_group("outputs") if grouped else p
    out.add_argument("--json", metavar="FILE", help="the run as JSON ('-' for stdout)")
    if not outputs:
        out.add_argument("--quiet", action="store_true", help="no progress on stderr")
        return
    out.add_argument("--csv", metavar="FILE", help="per-step metrics as CSV ('-' for stdout)")
    out.add_argument("--save-patches", metavar="FILE", help="the patches as safetensors")
    out.add_argument("--report", metavar="FILE",
                     help="HTML report (PDF when FILE ends in .pdf); every plot also goes to "
                          "FILE's name + '_plots/' as PNG and SVG")
    out.add_argument("--verify", action="store_true",
                     help="after the run, write each step's patches into the weights, run plain "
                          "transformers and compare (the result goes to the JSON and the "
                          "report)")
    out.add_argument("--quiet", action="store_true", help="no progress on stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ctxpatch",
        description="Context Patch Lab: a prompt's effect, rewritten as exact weight patches.",
    )
    parser.add_argument("--version", action="version", version=f"ctxpatch {__version__}")
    parser.add_argument("--screenshot", metavar="FILE",
                        help="open the window, run the comparison given by the options below, "
                             "save a PNG of the window to FILE and exit")
    window = parser.add_argument_group(
        "window options", "prefill the window (the same meaning as in 'compare'; "
        "options not given keep the window's saved settings)")
    _compare_options(window, grouped=False)
    for action in window._group_actions:
        action.default = argparse.SUPPRESS
    sub = parser.add_subparsers(dest="command", parser_class=_Parser,
                                help="run headless (without a command: open the window)")
    compare = sub.add_parser(
        "compare", help="run one comparison headless", epilog=EXAMPLES_COMPARE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare.families_in_help = True
    _compare_options(compare)
    _dynamics_parser(sub)
    verify = sub.add_parser(
        "verify", help="write saved patches into a copy of the weights and compare logits",
        epilog=EXAMPLES_VERIFY, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify.add_argument("patches", help="a patches file written by --save-patches")
    _model_options(verify, from_patches=True)
    verify.add_argument("--tolerance", type=float, default=None,
                        help="max logit L-inf difference relative to the logit scale "
                             "(default: 1e-3 float64, 1e-2 float32, token match only in 16-bit)")
    verify.add_argument("--json", metavar="FILE", help="the per-step checks as JSON ('-' for "
                        "stdout; the verdict then goes to stderr)")
    verify.add_argument("--image", default=None,
                        help="the context's picture, when the patches were made with one and it "
                             "is no longer at its recorded path (checked by its SHA-256)")
    bench = sub.add_parser(
        "bench", help="time and memory of a comparison next to plain generation (ratios)",
        description="Alternates plain greedy generate and the comparison K times after a "
                    "warm-up; peak memory of each in its own child process. The last line of "
                    "stdout is a JSON object with time_ratio and memory_ratio.",
        epilog=EXAMPLES_BENCH, formatter_class=argparse.RawDescriptionHelpFormatter)
    _compare_options(bench, outputs=False)
    bench.add_argument("--repeats", type=int, default=3,
                       help="timed alternations of generate and compare after a warm-up; the "
                            "medians are reported (default 3)")
    bench.add_argument("--no-memory", action="store_true", help="skip the memory children")
    bench.add_argument("--load", type=int, default=0, metavar="N",
                       help="time it on a busy machine: N CPU-bound processes run beside the "
                            "timed runs and stop with them (default 0)")
    repro = sub.add_parser(
        "reproduce", help="the paper's experiments: 5 prompts x {direct, stable} x "
                          "{float32, bfloat16}, absorb all, plus a start-layer sweep; one report; "
                          "or a prompt set of your own with 95%% intervals",
        description="Runs resume: each finished run is saved under OUT/runs and reused (never "
                    "mixed with runs made with other options). A prompt set adds bootstrap 95%% "
                    "intervals per setting: summary.json, summary.csv, prompts.csv.",
        epilog=EXAMPLES_REPRODUCE, formatter_class=argparse.RawDescriptionHelpFormatter)
    repro.add_argument("--model", default="demo", help="hub id, local folder, 'demo' or 'smollm2'")
    repro.add_argument("--out", default="ctxpatch-reproduction", help="output folder")
    repro.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    repro.add_argument("--max-new-tokens", type=int, default=20,
                       help="tokens per run (default 20, as in the paper)")
    repro.add_argument("--prompts", default="5", metavar="N|FILE",
                       help="the first N of the paper's 5 prompts (default 5), or a prompt set: "
                            "a .jsonl or .csv file of rows with query and optionally context, "
                            "image, id, or demo-set (34 bundled prompts)")
    repro.add_argument("--dtypes", default="float32,bfloat16",
                       help="precisions to run, separated by commas (default float32,bfloat16)")
    _set_options(repro)
    repro.add_argument("--image", nargs="?", const="sample", default=None, metavar="FILE",
                       help="add the paper's image run (Figure 5) with FILE, or the bundled "
                            "cat picture when FILE is left out (image+text models)")
    repro.add_argument("--sweep", default=None,
                       help="first patched layers to sweep, e.g. '0,4,9', or none (default: five "
                            "spread over the model)")
    _compile_parser(sub)
    return parser


def _set_options(p: argparse.ArgumentParser) -> None:
    """reproduce's grid and cluster options (`app.reproduce_set`)."""
    from .reproduce_set import add_set_arguments

    add_set_arguments(p)


def _dynamics_parser(sub: Any) -> None:
    from ..core.dynamics import OPTIONS

    p = sub.add_parser(
        "dynamics", help="how the patches grow as the context is read, token by token",
        description="For each prefix of the context's tokens, one comparison step with the "
                    "query fixed: per layer the patch's norm and its increment, each context "
                    "token's share of the increments and its increment's context-lens logit "
                    "for the answer (ANALYSIS.md A5).",
        epilog=EXAMPLES_DYNAMICS, formatter_class=argparse.RawDescriptionHelpFormatter)
    spec.add_arguments(p, OPTIONS)
    out = p.add_argument_group("outputs")
    out.add_argument("--json", metavar="FILE", help="the dynamics as JSON ('-' for stdout)")
    out.add_argument("--report", metavar="FILE",
                     help="HTML report (PDF when FILE ends in .pdf); its figures also go to "
                          "FILE's name + '_plots/' as PNG and SVG")
    out.add_argument("--quiet", action="store_true", help="no progress on stderr")


def run_dynamics(args: argparse.Namespace) -> int:
    from ..core.dynamics import dynamics, summary_lines
    from ..core.export import json_text, write_json
    from ..core.runs import prepare

    say = _Progress(args.quiet)
    run = spec.from_namespace(args)
    prepare(run)
    check_outputs({"--json": args.json, "--report": args.report}, _inputs(args),
                  text=("--json",))
    check_report(args.report, _inputs(args))
    loaded = _load(run, say)
    result = dynamics(loaded, run, lambda done, total: say("context prefix", done, total))
    if args.json == STDOUT:
        sys.stdout.write(json_text(result.to_dict()))
    elif args.json:
        write_json(args.json, result.to_dict())
    if args.report:  # last: the JSON above is safe whatever happens to the report
        from .report import write_dynamics_report

        report = Path(args.report)
        write_dynamics_report(result.to_dict(), report,
                              report.with_name(f"{report.stem}_plots"), _inputs(args))
        say(f"wrote the report {report} and its plots in {report.stem}_plots/")
    for line in summary_lines(result):  # (on stderr when stdout carries the JSON)
        if args.json == STDOUT:
            say(line)
        else:
            print(line)
    return 0


def _compile_parser(sub: Any) -> None:
    """``ctxpatch compile``: one weight delta per layer for a whole context, as a LoRA."""
    p = sub.add_parser(
        "compile", help="compile a context into one weight delta per layer (a PEFT LoRA "
        "adapter) and evaluate it on training and held-out queries without the context",
        epilog=EXAMPLES_COMPILE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.families_in_help = True
    spec.add_arguments(p, (*MODEL_OPTIONS, "max_new_tokens"), defaults={"max_new_tokens": 8})
    p.add_argument("--context", required=True, dest="text",
                   help="the context to compile into the weights")
    p.add_argument("--query", action="append", required=True, metavar="Q", dest="queries",
                   help="a training query (repeat for more)")
    p.add_argument("--held-out", action="append", default=[], metavar="Q",
                   help="a query to evaluate on that the fit never sees (at least one; repeat for "
                        "more)")
    p.add_argument("--rank", type=int, default=8, help="rank of each delta (default 8)")
    p.add_argument("--ridge", type=float, default=1e-3,
                   help="ridge lambda of the least squares (default 1e-3; 0: exact fit)")
    p.add_argument("--sweep", metavar="RANKS", default="",
                   help="also compile at each of these ranks, e.g. 1,2,4,8,16: the retained "
                        "effect against the rank (the JSON's curve, the report's figure)")
    p.add_argument("--adapter", metavar="DIR",
                   help="write the PEFT LoRA adapter into this new folder")
    p.add_argument("--json", metavar="FILE", help="the result as JSON ('-' for stdout)")
    p.add_argument("--report", metavar="FILE",
                   help="HTML report (PDF when FILE ends in .pdf); its figure also goes to "
                        "FILE's name + '_plots/' as PNG and SVG")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def run_compile(args: argparse.Namespace) -> int:
    from ..core.compile_record import (
        check_adapter_folder,
        check_rank,
        check_request,
        compile_record,
        parse_ranks,
    )

    say = _Progress(args.quiet)
    run = spec.from_namespace(args)
    sweep = parse_ranks(args.sweep)
    check_request(args.queries, args.held_out, args.rank, args.ridge, sweep,
                  run.max_new_tokens, context=args.text)
    if args.adapter is not None:
        check_adapter_folder(args.adapter, _inputs(args))
    check_outputs({"--json": args.json, "--report": args.report}, _inputs(args),
                  text=("--json",))
    check_report(args.report, _inputs(args))
    from ..core.compile import compile_context, rank_limit
    from ..core.export import json_text, write_json

    loaded = _load(run, say)
    check_rank(rank_limit(loaded), args.rank, sweep)  # (before any fit)
    compiled = compile_context(loaded, args.text, args.queries, args.held_out,
                               rank=args.rank, ridge=args.ridge,
                               max_new_tokens=run.max_new_tokens, say=say)
    compiled.evaluate()
    if args.adapter is not None:
        compiled.save_adapter(args.adapter)
        say(f"wrote the LoRA adapter {args.adapter}")
    record = compile_record(compiled, sweep)
    if args.json == STDOUT:
        sys.stdout.write(json_text(record))
    elif args.json:
        write_json(args.json, record)
    if args.report:  # last: the data above is safe whatever happens to the report
        from .report import write_compile_report

        report = Path(args.report)
        write_compile_report(record, report, report.with_name(f"{report.stem}_plots"),
                             _inputs(args))
        say(f"wrote the report {report} and its plots in {report.stem}_plots/")
    if args.json != STDOUT:
        for name in ("train", "held_out"):
            for r in record[name]:
                kept = "n/a" if r["retained"] is None else f"{r['retained']:.3f}"
                print(f"{name}: {r['query']!r}: match {r['match']}/{r['tokens']}, retained "
                      f"{kept}, answer without context {r['answer']!r} (with it "
                      f"{r['full_context_answer']!r})")
        for point in record["curve"]:
            pooled = point["pooled"]
            print(f"rank {point['rank']}: retained " + ", ".join(
                f"{name} {_kept(pooled[name]['retained'])} (match {pooled[name]['match']}/"
                f"{pooled[name]['tokens']})" for name in ("train", "held_out")))
    return 0


def _kept(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


class _Progress:
    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self._staged = (-1, "")  # (the last staged line printed: percent, its step)

    def __call__(self, message: str, done: int = 0, total: int = 0) -> None:
        from ..core.progress import SCALE

        if self.quiet:
            return
        if total == SCALE and message.startswith("Step "):  # staged (`core.progress.Stages`):
            # a percentage, every 5% or step (a count of exactly 1000 things stays a count)
            percent, step = done * 100 // SCALE, message.split(":", 1)[0]
            if percent < self._staged[0] + 5 and step == self._staged[1] and percent < 100:
                return
            self._staged = (percent, step)
            print(f"{message} ({percent}%)", file=sys.stderr, flush=True)
            return
        suffix = f" ({done}/{total})" if total else ""
        print(f"{message}{suffix}", file=sys.stderr, flush=True)


def _inputs(args: argparse.Namespace, *more: str | None) -> list[str | None]:
    """The paths a command reads (`core.outputs.run_inputs`)."""
    return run_inputs(getattr(args, "model", None), getattr(args, "image", None), *more)


def _load(run: Any, say: _Progress) -> Any:
    from ..core.runs import load

    return load(run, progress=say)  # (our progress lines; transformers' bars held back)


def run_compare(args: argparse.Namespace) -> int:
    from ..core.analysis import summary_lines as analysis_lines
    from ..core.controllability import conditioning_line, outcome, summary_lines
    from ..core.export import patches_made_with, save_patches, steps_csv, write_json, write_text
    from ..core.plan import RunPlan
    from ..core.results import summarize
    from ..core.runs import prepare, prompt_of, run_comparison, verify_run

    say = _Progress(args.quiet)
    run = spec.from_namespace(args, keep_patches=args.save_patches is not None or args.verify)
    picture = prepare(run)
    check_outputs({"--json": args.json, "--csv": args.csv, "--save-patches": args.save_patches,
                   "--report": args.report}, _inputs(args), text=("--json", "--csv"))
    check_report(args.report, _inputs(args))
    loaded = _load(run, say)
    prompt = prompt_of(loaded, run, picture)
    plan = RunPlan.build(loaded, prompt, run)
    plans = plan.report
    if ("transfer" in plan.spec.analyze and plan.spec.method == "direct"
            and plan.patch.output_control == "scale"):  # (docs/ANALYSES.md, Transfer)
        print("ctxpatch: warning: the transfer writes each step's patches into the weights' "
              "action, and method direct's post-norm-scale patches are unbounded here, so even "
              "the diagonal will not reproduce the run: add --method stable", file=sys.stderr)
    for line in summary_lines(plans):
        say(line)

    def progress(s: Any) -> None:
        say(f"token {s.step + 1}/{run.max_new_tokens}: {s.baseline_text!r} "
            f"{'match' if s.patched.match else 'MISMATCH ' + repr(s.patched.text)} "
            f"linf={s.patched.linf:.3g} control linf={s.control.linf:.3g}")

    done = run_comparison(loaded, prompt, run, progress, plan=plan,
                          transfer_progress=lambda d, t: say("transfer: pass", d, t))
    steps, record = done.steps, done.record
    elapsed = record["summary"]["seconds"]["wall"]
    say(summary_lines(plans, outcome(steps, plans))[-1])
    say(conditioning_line(record["summary"]["conditioning"]))
    for line in analysis_lines(record.get("analysis")):
        say(line)
    if args.verify:
        result = verify_run(loaded, done, lambda d, t: say("checking step", d, t))
        say(f"{'verified' if result.ok else 'verification FAILED'}: {result.matches}/"
            f"{result.steps} tokens match with the patches written into the weights, max L-inf "
            f"{result.worst:.3g} of the logit scale")
    if args.json == STDOUT:
        from ..core.export import json_text

        sys.stdout.write(json_text(record))
    elif args.json:
        write_json(args.json, record)
    if args.csv == STDOUT:
        sys.stdout.write(steps_csv(steps))
    elif args.csv:
        write_text(args.csv, steps_csv(steps))
    if args.save_patches:
        n = save_patches(args.save_patches, steps, run.model, run.dtype, done.spec,
                         image=done.prompt.image,
                         made_with=patches_made_with(loaded, done.prompt.image is not None))
        say(f"saved {n} patch tensors to {args.save_patches}")
    if args.report:  # last: the data above is safe whatever happens to the report
        from ..core.record import read_record
        from .report import write_report

        report = Path(args.report)
        write_report(read_record(record), report, report.with_name(f"{report.stem}_plots"),
                     _inputs(args))
        say(f"wrote the report {report} and its plots in {report.stem}_plots/")
    if STDOUT not in (args.json, args.csv):  # stdout carries only the data asked for
        summary = summarize(steps)
        p, c = summary["patched"], summary["control"]
        baseline = "".join(s.baseline_text for s in steps)
        patched = "".join(s.patched.text for s in steps)
        print(f"baseline (with context):   {baseline!r}")
        print(f"patched (without context): {patched!r}")
        control = ("control: off" if c is None else
                   f"control: match {c['matches']}/{summary['tokens']}  "
                   f"max L-inf {c['max_linf']:.3g}")
        print(f"token match {p['matches']}/{summary['tokens']}  max L-inf {p['max_linf']:.3g}  "
              f"mean TVD {p['mean_tvd']:.3g}  |  {control}  |  {elapsed:.1f} s")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    import json

    from ..core.bench import background_load, machine, measure_memory, measure_time
    from ..core.plan import resolve_control_row
    from ..core.prompt import check_prompt
    from ..core.runs import prepare, prompt_of

    say = _Progress(args.quiet)
    if args.repeats < 1:
        raise UserError("--repeats must be at least 1")
    if not 0 <= args.load <= 64:
        raise UserError("--load must be between 0 and 64 (the busy processes beside the runs)")
    # generate cannot stop at EOS like the comparison would: both always make every token
    run = spec.from_namespace(args, stop_at_eos=False)
    picture = prepare(run) if run.image is not None else None
    check_outputs({"--json": args.json}, _inputs(args), text=("--json",))
    loaded = _load(run, say)
    prompt = prompt_of(loaded, run, picture)
    check_prompt(prompt, run.absorb)
    run = resolve_control_row(loaded, run)  # (the JSON says which control row ran)
    result: dict[str, Any] = {"machine": machine(), "model": run.model, "dtype": run.dtype,
                              "device": str(loaded.device), "settings": run.to_dict(),
                              "prompt_tokens": len(prompt.full_ids), "load": args.load}
    with background_load(args.load):
        result.update(measure_time(loaded, prompt, run, args.repeats, say))
    print(f"generate {result['generate_s']:.2f} s, compare {result['compare_s']:.2f} s "
          f"(medians of {args.repeats}): time ratio {result['time_ratio']:.2f}, "
          f"{result['syncs_per_token']:.1f} host syncs per token")
    if not args.no_memory:
        say("measuring peak memory in child processes")
        del loaded
        result["memory"] = measure_memory(run)
        result["memory_ratio"] = result["memory"]["memory_ratio"]
        m = result["memory"]
        print(f"peak memory ({m['generate']['kind']}): generate "
              f"{m['generate']['peak_bytes'] / 1e9:.2f} GB, compare "
              f"{m['compare']['peak_bytes'] / 1e9:.2f} GB: memory ratio {m['memory_ratio']:.2f}")
    if args.json == STDOUT:  # the whole result, runs included, as the last line
        print(json.dumps(result, default=str))
        return 0
    if args.json:
        from ..core.export import write_json

        write_json(args.json, result)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, default=str))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from ..core.controllability import conditioning_line
    from ..core.patchfile import read_header
    from ..core.runs import default_tolerance, verdict
    from ..core.verify import (
        check_made_with,
        image_pixels,
        read_patches,
        recorded_image,
        verify_patches,
    )

    say = _Progress(False)
    default_tolerance("float64", args.tolerance)  # a bad --tolerance fails before any work
    # the header alone first (no tensors): the model and the picture it names are inputs too,
    # which --json must not overwrite, checked before anything is read or loaded
    header = read_header(args.patches)
    model = args.model or header.get("model") or "demo"
    recorded = (header.get("image") or {}).get("path")
    check_outputs({"--json": args.json}, run_inputs(model, args.image, recorded, args.patches),
                  text=("--json",))
    pf = read_patches(args.patches, header)
    dtype = args.dtype or pf.header.get("dtype", "float32")
    run = spec.from_namespace(args, model=model, dtype=dtype)
    picture = recorded_image(pf, args.image)
    loaded = _load(run, say)
    pixels = image_pixels(loaded, picture)
    say(conditioning_line(pf.conditioning))
    weights = check_made_with(loaded, pf)  # (another model or other weights: one line, exit 2)
    say(f"weights: {weights}")
    checks = verify_patches(loaded, pf, progress=lambda d, t: say("checking step", d, t),
                            pixels=pixels, made_with=False)
    result = verdict(checks, default_tolerance(dtype, args.tolerance))
    checked = (f"checked: {len(checks)} step(s) with {pf.tensor_count} patch tensor(s) written "
               f"into the weights; weights {weights}")
    if args.json:
        import json
        from dataclasses import asdict

        from ..core.export import write_json

        data = {"ok": result.ok, "tolerance": result.to_dict()["tolerance"],
                "conditioning": pf.conditioning, "steps": [asdict(c) for c in checks],
                "checked": {"steps": len(checks), "patch_tensors": pf.tensor_count,
                            "weights": weights}}
        if args.json == STDOUT:
            print(json.dumps(data, indent=1))
        else:
            write_json(args.json, data)
    verdict_to = sys.stderr if args.json == STDOUT else sys.stdout
    print(result.line(), file=verdict_to)
    print(checked, file=verdict_to)
    return 0 if result.ok else 1


def _open_window(args: argparse.Namespace) -> int:
    from .gui import run_app

    return run_app(args)


def _command(args: argparse.Namespace) -> int:
    if args.command == "compare":
        return run_compare(args)
    if args.command == "verify":
        return run_verify(args)
    if args.command == "dynamics":
        return run_dynamics(args)
    if args.command == "bench":
        return run_bench(args)
    if args.command == "compile":
        return run_compile(args)
    from .reproduce import run as run_reproduce

    for d in args.dtypes.split(","):
        if d not in DTYPES:
            raise UserError(f"unknown dtype {d!r} in --dtypes: use float32, bfloat16, "
                            "float16 or float64, separated by commas")
    return run_reproduce(args, _Progress(False))


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as Ctrl+C is, so that a command's cleanup runs (temporaries removed,
    an output whole or absent) before it exits with status 143."""


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    def stop(signum: int, frame: Any) -> None:
        raise Terminated

    try:
        old = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: leave the signal alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad option (already printed)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.command is None:
            return _open_window(args)
        with _terminate_as_interrupt():
            return _command(args)
    except UserError as exc:
        print(f"ctxpatch: error: {exc.words('cli')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print("ctxpatch: interrupted", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130
    except BrokenPipeError:  # the reader went away (`ctxpatch ... | head -1`): not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush stays quiet
        return 0
    except Exception as exc:  # noqa: BLE001 - out of memory is the user's to fix: say how
        if not isinstance(exc, MemoryError) and type(exc).__name__ != "OutOfMemoryError":
            return _internal(exc)
        print(f"ctxpatch: error: out of memory ({type(exc).__name__}): {OOM_HINT}", file=sys.stderr)
        return 2



OOM_HINT = ("use a 16-bit dtype (--dtype bfloat16), a smaller model, fewer new tokens, a shorter "
            "context, or --device cpu")


def _internal(exc: Exception) -> int:
    """The last line of defence: one line, exit 1 (CTXPATCH_DEBUG=1 re-raises)."""
    if os.environ.get("CTXPATCH_DEBUG"):
        raise exc
    print(f"ctxpatch: internal error: {type(exc).__name__}: {exc} "
          "(set CTXPATCH_DEBUG=1 for the traceback)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
