"""Images as context (PAPER.md section 6): reading a picture and turning it into the model's own
image tokens and pixel inputs.

The model's processor expands one image marker into the image tokens (Gemma 3:
``\\n\\n<start_of_image>`` + 256 soft tokens + ``<end_of_image>\\n\\n``; LLaVA: N ``<image>``
tokens) and makes the pixel values. The image tokens form an absorbed segment of the prompt: the
full-context run sees them with the pixels, the reduced run has neither.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from core.errors import UserError

#: image+text model types whose language model is one of our adapters' families, and which are
#: tested (tiny random models in float64). Others with a vision tower are refused by name
#: (Qwen2-VL's, SmolVLM2's and Mistral 3's processors need torchvision).
IMAGE_TEXT_TYPES: dict[str, str] = {
    "gemma3": "Gemma 3 (Gemma3ForConditionalGeneration)",
    "llava": "LLaVA (LlavaForConditionalGeneration: Llama, Mistral or Qwen language model)",
    "llava_next": "LLaVA-NeXT (LlavaNextForConditionalGeneration, any-resolution tiles)",
    "idefics3": "Idefics3 and SmolVLM (Idefics3ForConditionalGeneration: image splitting)",
}

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


def read_image(path: str | Path) -> tuple[Any, ImageInfo]:
    """Decode a PNG, JPEG, WebP or GIF (first frame) into an RGB Pillow image.

    Raises:
        UserError: a missing file, a folder, or a file that is not a readable picture.
    """
    from PIL import Image, UnidentifiedImageError

    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"no such image file: {path}")
    if not p.is_file():
        raise UserError(f"{path} is a folder, not an image: give a PNG, JPEG, WebP or GIF file")
    data = p.read_bytes()  # read once: hashed, then decoded
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = im.format or "?"
            if fmt not in FORMATS:
                raise UserError(f"{path} is a {fmt} image: use a PNG, JPEG, WebP or GIF file")
            im.seek(0)  # a GIF's first frame
            rgb = im.convert("RGB")
            rgb.load()
    except UserError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
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
                        "pass --image FILE with the same picture")
    where = path or info.path
    image, found = read_image(where)
    if found.sha256 != info.sha256:
        raise UserError(f"{where} is not the image {what} were made with (sha256 "
                        f"{found.sha256[:12]}..., recorded {info.sha256[:12]}...)")
    return image, found


def image_marker(processor: Any) -> str:
    """The text the processor expands into one image's tokens (Gemma 3's ``<start_of_image>``,
    LLaVA's ``<image>``)."""
    marker = getattr(processor, "image_token", None)
    if not marker:
        raise UserError(f"{type(processor).__name__} names no image token: this model cannot "
                        "take an image here")
    return str(marker)


def encode_image(processor: Any, image: Any) -> tuple[tuple[int, ...], dict[str, Any]]:
    """(the image's token ids, its pixel inputs), from the model's own processor."""
    try:
        out = processor(text=image_marker(processor), images=[image], add_special_tokens=False,
                        return_tensors="pt")
    except (ValueError, OSError, TypeError) as exc:
        raise UserError(f"the model's processor cannot use this image: {str(exc).splitlines()[0]}"
                        ) from None
    ids = tuple(int(i) for i in out["input_ids"][0])
    pixels = {k: v for k, v in out.items()
              if k not in ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")}
    if "token_type_ids" in out or "mm_token_type_ids" in out:
        pixels["token_type_ids"] = None  # built over the whole sequence (`vision_kwargs`)
    return ids, pixels


def vision_kwargs(model: Any, pixels: dict[str, Any], ids: Any) -> dict[str, Any]:
    """The extra forward arguments of a run over ``ids`` (a [1, n] tensor from position 0) that
    contains the image tokens: the pixels in the model's dtype and, where the model reads them
    (Gemma 3's bidirectional attention over an image), token types marking the image tokens."""
    import torch

    out: dict[str, Any] = {}
    for key, value in pixels.items():
        if key == "token_type_ids":
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
