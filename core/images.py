"""Images as context (PAPER.md section 6): reading a picture and turning it into the model's own
image tokens and pixel inputs.

The model's processor expands one image marker into the image tokens (Gemma 3:
``\\n\\n<start_of_image>`` + 256 soft tokens + ``<end_of_image>\\n\\n``; LLaVA: N ``<image>``
tokens) and makes the pixel values. The image tokens form an absorbed segment of the prompt: the
full-context run sees them with the pixels, the reduced run has neither.
"""

from __future__ import annotations

import functools
import hashlib
import io
import itertools
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import UserError, mention

#: image+text model types whose language model is one of our adapters' families, and which are
#: tested (tiny random models in float64, their processors built without torchvision). Others with
#: a vision tower are refused by name.
IMAGE_TEXT_TYPES: dict[str, str] = {
    "gemma3": "Gemma 3 (Gemma3ForConditionalGeneration)",
    "llava": "LLaVA (LlavaForConditionalGeneration: Llama, Mistral or Qwen language model)",
    "llava_next": "LLaVA-NeXT (LlavaNextForConditionalGeneration, any-resolution tiles)",
    "idefics3": "Idefics3 and SmolVLM (Idefics3ForConditionalGeneration: image splitting)",
    "qwen2_vl": "Qwen2-VL (Qwen2VLForConditionalGeneration: M-RoPE over the image grid)",
    "qwen2_5_vl": "Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration: M-RoPE, windowed vision)",
    "qwen3_vl": ("Qwen3-VL (Qwen3VLForConditionalGeneration: interleaved M-RoPE, DeepStack "
                 "vision features)"),
    "glm4v": "GLM-4.1V (Glm4vForConditionalGeneration: M-RoPE, GLM-4 language model)",
    "mistral3": "Mistral 3 (Mistral3ForConditionalGeneration: Pixtral tower, image breaks)",
    "paligemma": "PaliGemma and PaliGemma 2 (PaliGemmaForConditionalGeneration: prefix-LM)",
    "aya_vision": "Aya Vision (AyaVisionForConditionalGeneration: pixel shuffle, Cohere 2)",
    "idefics2": "Idefics2 (Idefics2ForConditionalGeneration: perceiver resampler)",
    "smolvlm": "SmolVLM2 (SmolVLMForConditionalGeneration: image splitting, pixel shuffle)",
    "llava_onevision": ("LLaVA-OneVision (LlavaOnevisionForConditionalGeneration: any-resolution "
                        "tiles, Qwen2)"),
    "internvl": "InternVL (InternVLForConditionalGeneration: tiles, pixel shuffle, Qwen2 or Llama)",
    "gemma4": "Gemma 4 (Gemma4ForConditionalGeneration: variable-resolution patches, pooled)",
}


@dataclass(frozen=True)
class InputRules:
    """What a family's runs need beyond input ids and the processor's pixel inputs."""

    #: runs without the image get the language model's plain positions (0, 1, ...) explicitly:
    #: the model keeps the full run's position offset between calls (Qwen2-VL's M-RoPE
    #: ``rope_deltas``, which a cached text-only call would pick up), or counts from 1 where its
    #: language model counts from 0 (PaliGemma)
    plain_positions: bool = False
    #: what the token types (`TYPE_KEYS`) mark: "image", the image tokens (1, the others 0);
    #: "generated", the tokens after the prompt (1; PaliGemma's prefix-LM attends both ways over
    #: the whole prompt, 0, image and text alike)
    token_types: str = "image"


#: the families with rules of their own (the others need none)
INPUT_RULES: dict[str, InputRules] = {
    "qwen2_vl": InputRules(plain_positions=True),
    "qwen2_5_vl": InputRules(plain_positions=True),
    "qwen3_vl": InputRules(plain_positions=True),
    "glm4v": InputRules(plain_positions=True),
    "paligemma": InputRules(plain_positions=True, token_types="generated"),
}

#: processor outputs that mark each token's kind (Gemma 3's ``token_type_ids``: the image attended
#: both ways; Qwen2-VL's ``mm_token_type_ids``: where M-RoPE's grid positions go; PaliGemma's
#: ``token_type_ids``: its prompt prefix): rebuilt over the whole sequence of each run
#: (`vision_kwargs`)
TYPE_KEYS = ("token_type_ids", "mm_token_type_ids")

#: processor outputs that are not the pixels' and never reach the model (PaliGemma's ``labels``)
TEXT_KEYS = ("input_ids", "attention_mask", "labels")


def input_rules(config: Any) -> InputRules:
    """The input rules of a model's family (no special rules for text-only models)."""
    return INPUT_RULES.get(getattr(config, "model_type", None) or "", InputRules())


FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


@dataclass(frozen=True)
class ImageInfo:
    """What a run records of its image: enough to find it again and check it is the same."""

    path: str
    sha256: str
    width: int
    height: int
    format: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ImageInfo:
        return cls(**{k: data[k] for k in ("path", "sha256", "width", "height", "format")})


#: the largest picture we decode (width x height): 8K x 8K; Pillow's own guard is ~89 M pixels
#: with a warning and 179 M with an error, both after the header is read
MAX_PIXELS = 7680 * 7680
#: the largest picture file we read into memory
MAX_IMAGE_BYTES = 256 * 1024 * 1024


def _read_file(p: Path, path: str) -> bytes:
    """A regular file's bytes, opened without blocking (a pipe swapped in after a check never
    hangs the caller) and checked as opened; a read error is one line."""
    not_file = (f"{path} is not a file (a pipe or a device): give a PNG, JPEG, WebP or GIF "
                "file")
    too_large = f"{path} is larger than {MAX_IMAGE_BYTES >> 20} MB: give a smaller picture"
    if not p.is_file():
        raise UserError(not_file)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UserError(not_file)
        if info.st_size > MAX_IMAGE_BYTES:
            raise UserError(too_large)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
    except OSError as exc:  # e.g. /proc/self/mem: a regular file that cannot be read
        raise UserError(f"cannot read {path} ({exc.strerror or exc}): give a PNG, JPEG, WebP "
                        "or GIF file") from None
    finally:
        os.close(fd)
    if len(data) > MAX_IMAGE_BYTES:  # (grew while read)
        raise UserError(too_large)
    return data


def read_image(path: str | Path) -> tuple[Any, ImageInfo]:
    """Decode a PNG, JPEG, WebP or GIF (first frame) into an RGB Pillow image.

    Raises:
        UserError: a missing file, a folder or another non-file, a file that is not a readable
            picture, or one too large to decode (a decompression bomb).
    """
    import warnings

    from PIL import Image, UnidentifiedImageError

    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"no such image file: {path}")
    if p.is_dir():
        raise UserError(f"{path} is a folder, not an image: give a PNG, JPEG, WebP or GIF file")
    data = _read_file(p, str(path))  # read once: hashed, then decoded
    try:
        with warnings.catch_warnings():  # Pillow's warnings become our one line, not stderr
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as im:
                fmt = im.format or "?"
                if fmt not in FORMATS:
                    raise UserError(f"{path} is a {fmt} image: use a PNG, JPEG, WebP or GIF file")
                if im.width * im.height > MAX_PIXELS:
                    raise UserError(f"{path} is {im.width} x {im.height} pixels, more than we "
                                    "decode (8K x 8K): give a smaller picture")
                im.seek(0)  # a GIF's first frame
                rgb = im.convert("RGB")
                rgb.load()
    except UserError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise UserError(f"{path} is too large to decode safely (a decompression bomb?): give a "
                        "smaller picture") from None
    except UnidentifiedImageError:
        raise UserError(f"cannot read {path} as an image (not a picture Pillow knows): give a "
                        "PNG, JPEG, WebP or GIF file") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"cannot read {path} as an image ({reason}): give a PNG, JPEG, WebP or "
                        "GIF file") from None
    info = ImageInfo(str(p.resolve()), hashlib.sha256(data).hexdigest(), rgb.width, rgb.height, fmt)
    return rgb, info


def reopen(info: ImageInfo, path: str | None = None, what: str = "these patches"
           ) -> tuple[Any, ImageInfo]:
    """The recorded picture again: at its recorded path, or at ``path``, checked by its hash.

    Raises:
        UserError: the file is gone (and no ``path`` was given), unreadable, or another picture.
    """
    if path is None and not Path(info.path).is_file():
        raise UserError(f"{what} were made with the image {info.path}, which is gone: "
                        f"pass {mention('image', metavar='FILE')} with the same picture")
    where = path or info.path
    image, found = read_image(where)
    if found.sha256 != info.sha256:
        raise UserError(f"{where} is not the image {what} were made with (sha256 "
                        f"{found.sha256[:12]}..., recorded {info.sha256[:12]}...)")
    return image, found


@functools.cache
def pictures_only(cls: type) -> type:
    """``cls``, a processor class that also takes videos, for pictures alone: its video processor,
    which a picture never uses and which needs torchvision (none matches every torch build), is
    not built. The class keeps ``cls``'s name, so saved files name the model's own processor."""
    import inspect
    import types

    # ``cls.__init__`` itself (transformers reads its code's argument names to pick the saved
    # settings it takes), with every argument optional: the video processor stays None, and the
    # mixin, whose sub-processors are those of the signature below, drops it
    base = cls.__init__
    names = base.__code__.co_varnames[1:base.__code__.co_argcount]
    defaults = base.__defaults__ or ()
    init = types.FunctionType(base.__code__, base.__globals__, "__init__",
                              (None,) * (len(names) - len(defaults)) + defaults, base.__closure__)
    init.__kwdefaults__ = base.__kwdefaults__
    own = inspect.signature(base)
    init.__signature__ = own.replace(  # type: ignore[attr-defined]
        parameters=[p for name, p in own.parameters.items() if name != "video_processor"])
    # (`_video_keyword_dropped` comes between ``cls`` and the mixin: it takes the
    # ``video_processor=None`` that some processors (Gemma 4) pass to the mixin by name)
    return type(cls.__name__, (cls, _video_keyword_dropped()),
                {"__init__": init, "__module__": cls.__module__,
                 "__qualname__": cls.__qualname__, "video_processor": _NoVideos()})


@functools.cache
def _video_keyword_dropped() -> type:
    from transformers.processing_utils import ProcessorMixin

    class VideoKeywordDropped(ProcessorMixin):
        """The mixin without the absent video processor given by name."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if kwargs.get("video_processor", 0) is None:
                del kwargs["video_processor"]
            super().__init__(*args, **kwargs)

    return VideoKeywordDropped


class _NoVideos:
    """Where a pictures-only processor's video processor would be, for code that reads its
    settings even without a video (SmolVLM's chat template: the frame count and rate)."""

    num_frames = None
    fps = None

    def __bool__(self) -> bool:
        return False


#: processor modules whose top level imports a torchvision image processor's module for a helper
#: that its PIL module also has (and that a picture never calls): processing module -> (the
#: torchvision module, its PIL stand-in)
PIL_STAND_INS: dict[str, tuple[str, str]] = {
    "pixtral.processing_pixtral": ("pixtral.image_processing_pixtral",
                                   "pixtral.image_processing_pil_pixtral"),
}


def _processor_module(name: str) -> Any:
    """transformers' module ``models.{name}``, imported where torchvision is missing with the PIL
    stand-in (`PIL_STAND_INS`) in place of its torchvision import."""
    import importlib
    import sys

    from transformers.utils import is_torchvision_available

    full = f"transformers.models.{name}"
    if name not in PIL_STAND_INS or full in sys.modules or is_torchvision_available():
        return importlib.import_module(full)
    tv, pil = (f"transformers.models.{m}" for m in PIL_STAND_INS[name])
    sys.modules[tv] = importlib.import_module(pil)
    try:
        return importlib.import_module(full)
    finally:
        del sys.modules[tv]  # (the torchvision module itself still cannot be imported)


def processor_class(config: Any) -> type | None:
    """The processor class of a supported image+text family that transformers' AutoProcessor
    cannot build without torchvision: for pictures alone (`pictures_only`) where it also takes
    videos, or imported with a PIL stand-in (`PIL_STAND_INS`). None for the others (AutoProcessor
    loads them)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    name = PROCESSOR_MAPPING_NAMES.get(model_type or "")
    if model_type not in IMAGE_TEXT_TYPES or not isinstance(name, str):
        return None
    owner = next(t for t, n in PROCESSOR_MAPPING_NAMES.items() if n == name)  # (mistral3: pixtral)
    folder = model_type_to_module_name(owner)
    module = f"{folder}.processing_{folder}"
    cls = getattr(_processor_module(module), name)
    if "video_processor" in cls.get_attributes():
        return pictures_only(cls)
    return cls if module in PIL_STAND_INS else None


@dataclass(frozen=True)
class ImageLayout:
    """Where a processor's image tokens go in a prompt."""

    #: text the model expects around the image token, which the processor does not add itself
    #: (in the family's chat template too)
    around: tuple[str, str] = ("", "")
    #: the image goes before BOS, and this ends the prompt (PaliGemma's layout: the image
    #: tokens, BOS, the prompt, a newline); None: BOS, the image, the prompt
    image_first_end: str | None = None


#: processors (by class name) whose image tokens do not simply follow BOS
LAYOUTS: dict[str, ImageLayout] = {
    "Qwen2VLProcessor": ImageLayout(around=("<|vision_start|>", "<|vision_end|>")),
    "Qwen2_5_VLProcessor": ImageLayout(around=("<|vision_start|>", "<|vision_end|>")),
    "Qwen3VLProcessor": ImageLayout(around=("<|vision_start|>", "<|vision_end|>")),
    "Glm4vProcessor": ImageLayout(around=("<|begin_of_image|>", "<|end_of_image|>")),
    "PaliGemmaProcessor": ImageLayout(image_first_end="\n"),
}


def image_layout(processor: Any) -> ImageLayout:
    return LAYOUTS.get(type(processor).__name__, ImageLayout())


def image_marker(processor: Any) -> str:
    """The text the processor expands into one image's tokens (Gemma 3's ``<start_of_image>``,
    LLaVA's ``<image>``, Qwen2-VL's ``<|vision_start|><|image_pad|><|vision_end|>``)."""
    marker = getattr(processor, "image_token", None)
    if not marker:
        raise UserError(f"{type(processor).__name__} names no image token: this model cannot "
                        "take an image here")
    before, after = image_layout(processor).around
    return f"{before}{marker}{after}"


def encode_image(processor: Any, image: Any) -> tuple[tuple[int, ...], dict[str, Any]]:
    """(the image's token ids, its pixel inputs), from the model's own processor."""
    try:
        out = processor(text=image_marker(processor), images=[image], add_special_tokens=False,
                        return_tensors="pt")
    except (ValueError, OSError, TypeError) as exc:
        raise UserError(f"the model's processor cannot use this image: {str(exc).splitlines()[0]}"
                        ) from None
    ids = tuple(int(i) for i in out["input_ids"][0])
    if image_layout(processor).image_first_end is not None:  # (the processor's BOS and end)
        ids = tuple(itertools.takewhile(lambda i: i != processor.tokenizer.bos_token_id, ids))
    pixels = {k: v for k, v in out.items() if k not in TEXT_KEYS + TYPE_KEYS}
    pixels.update({k: None for k in TYPE_KEYS if k in out})  # built over each run's ids
    return ids, pixels


def vision_kwargs(model: Any, pixels: dict[str, Any], ids: Any, prompt_length: int | None = None
                  ) -> dict[str, Any]:
    """The extra forward arguments of a run over ``ids`` (a [1, n] tensor from position 0) that
    contains the image tokens: the pixels in the model's dtype and, where the model reads them
    (Gemma 3's bidirectional attention over an image, Qwen2-VL's M-RoPE, PaliGemma's prefix-LM),
    token types (`TYPE_KEYS`, `InputRules.token_types`). ``prompt_length``: how many of ``ids``
    are the prompt (the rest were generated); None: all."""
    import torch

    out: dict[str, Any] = {}
    for key, value in pixels.items():
        if key in TYPE_KEYS and value is None:
            if input_rules(model.config).token_types == "generated":
                types = torch.zeros_like(ids)
                types[:, ids.shape[1] if prompt_length is None else prompt_length:] = 1
                out[key] = types
                continue
            token = getattr(model.config, "image_token_id", None)
            if token is None:
                token = model.config.image_token_index
            out[key] = (ids == token).long()
        elif isinstance(value, torch.Tensor):
            cast = value.is_floating_point()
            out[key] = value.to(ids.device, model.dtype if cast else value.dtype)
        else:
            out[key] = value
    return out


def check_image_text(config: Any) -> None:
    """Refuse an image+text model type we have not tested, naming the ones we have."""
    if getattr(config, "vision_config", None) is None:
        return
    if config.model_type not in IMAGE_TEXT_TYPES:
        raise UserError(
            f"image+text model type {config.model_type!r} is not supported yet; supported: "
            + "; ".join(IMAGE_TEXT_TYPES.values())
        )


def text_only(what: str = "this model") -> UserError:
    """The error for an image given to a text-only model."""
    return UserError(f"{what} reads text only and cannot take an image: use an image+text model "
                     "(Gemma 3 4B and larger, LLaVA, LLaVA-NeXT, SmolVLM), or run without the "
                     "image")
