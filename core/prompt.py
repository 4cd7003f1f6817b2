"""Segments -> full ids, reduced ids and positions: the only place that decides them.

A prompt is an ordered list of segments (template text, image, context, query), each tokenized on
its own and concatenated, so the reduced sequence is an exact id-level sub-sequence of the full one.
An image segment holds the image tokens the model's processor made; it is absorbed like context.

- Absorb mode "context": Y = the context segments. The reduced sequence is the full one without
  them, then the generated history; positions are 0..n-1 (the model simply never saw the context).
- Absorb mode "all" (the paper's protocol): Y = everything before the current token. The reduced
  sequence is the current token alone at its absolute position (optionally after BOS at 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import UserError, mention
from .images import ImageInfo, encode_image, image_layout, image_marker, text_only
from .options import ABSORB_MODES

#: segment kinds that absorb mode "context" takes out of the reduced sequence
ABSORBED = ("context", "image")


#: Appended to a non-empty context before the query; it belongs to the context (is absorbed).
CONTEXT_SEPARATOR = "\n\n"

_CTX, _QRY = "\x00CTXPATCH_CONTEXT\x00", "\x00CTXPATCH_QUERY\x00"


@dataclass(frozen=True)
class Segment:
    """One piece of the prompt: ``kind`` is "template", "image", "context" or "query"."""

    kind: str
    text: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Prompt:
    """The tokenized prompt; its segments concatenate to the full-context ids."""

    segments: tuple[Segment, ...]
    bos_id: int | None = None
    image: ImageInfo | None = None
    #: the processor's pixel inputs for the image segment (tensors; never serialized)
    pixels: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def full_ids(self) -> tuple[int, ...]:
        return tuple(i for s in self.segments for i in s.ids)

    @property
    def reduced_prompt_ids(self) -> tuple[int, ...]:
        """The prompt without its context segments (absorb mode "context")."""
        return tuple(i for s in self.segments if s.kind not in ABSORBED for i in s.ids)

    @property
    def has_context(self) -> bool:
        return any(s.kind in ABSORBED and s.ids for s in self.segments)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "segments": [{"kind": s.kind, "text": s.text, "ids": list(s.ids)}
                         for s in self.segments],
            "full_input_ids": list(self.full_ids),
            "reduced_input_ids": list(self.reduced_prompt_ids),
            "bos_id": self.bos_id,
        }
        if self.image is not None:
            out["image"] = self.image.to_dict()
        return out


def _encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    if not text:
        return ()
    return tuple(int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"])


def _adds_bos(tokenizer: Any) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == bos


def has_chat_template(tokenizer: Any, processor: Any = None) -> bool:
    """Whether the tokenizer, or an image+text model's processor, has a chat template."""
    return bool(getattr(tokenizer, "chat_template", None)
                or getattr(processor, "chat_template", None))


def _render_chat(tokenizer: Any, processor: Any, context: str, image: bool) -> str:
    """One user turn (the image first, then the text) with the generation prompt, through the
    processor's template when there is an image or the tokenizer has none."""
    text = (_CTX if context else "") + _QRY
    if not has_chat_template(tokenizer, processor):
        raise UserError("this tokenizer has no chat template: run without "
                        f"{mention('chat_template')}")
    if getattr(processor, "chat_template", None) and (image or not has_chat_template(tokenizer)):
        owner, content = processor, [{"type": "text", "text": text}]
        if image:
            content.insert(0, {"type": "image"})
    else:
        owner, content = tokenizer, text
        if image:  # the tokenizer's own template, given multimodal content
            content = [{"type": "image"}, {"type": "text", "text": text}]
    return str(owner.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True))


def build_prompt(tokenizer: Any, context: str, query: str, chat_template: bool = False,
                 image: tuple[Any, ImageInfo] | None = None, processor: Any = None) -> Prompt:
    """Split a context and a query (and an image) into tokenized segments.

    Args:
        tokenizer: the model's tokenizer.
        context: text to absorb (may be empty with absorb mode "all", or with an image).
        query: text kept in the reduced sequence.
        chat_template: wrap both in the chat template as one user turn with the generation
            prompt (the image first); else raw text after BOS (the paper's setting): BOS, the
            image, the context, the query.
        image: a decoded picture and its record (`core.images.read_image`), absorbed with the
            context; needs ``processor``.
        processor: the image+text model's processor (None for a text-only model).
    """
    if image is not None and processor is None:
        raise text_only()
    ctx_text = context + CONTEXT_SEPARATOR if context else ""
    picture: Segment | None = None
    pixels: dict[str, Any] | None = None
    if image is not None:
        ids, pixels = encode_image(processor, image[0])
        picture = Segment("image", image_marker(processor), ids)
    segments: list[Segment] = []
    if chat_template:
        # rendered = pre [image] mid [context] query tail; what lies between the image and the
        # context (a newline, say) belongs to the image and is absorbed with it
        rendered = _render_chat(tokenizer, processor, context, picture is not None)
        head, _, tail = rendered.partition(_QRY)
        head = head.partition(_CTX)[0]
        pre, mid = head, ""
        if picture is not None:
            pre, found, mid = head.partition(picture.text)
            if not found:
                raise UserError("this chat template does not put the image before the text: run "
                                f"without {mention('chat_template')}")
        segments = [Segment("template", pre, _encode(tokenizer, pre))] if pre else []
        if picture is not None:
            segments.append(picture)
        pieces = [("context", mid + ctx_text), ("query", query), ("template", tail)]
        segments += [Segment(k, t, _encode(tokenizer, t)) for k, t in pieces if t]
    else:
        # BOS, the image, the context, the query; or (PaliGemma) the image, BOS, ..., its end
        end = None if picture is None else image_layout(processor).image_first_end
        if picture is not None and end is not None:
            segments.append(picture)
        if _adds_bos(tokenizer) or (end is not None and tokenizer.bos_token_id is not None):
            bos = tokenizer.bos_token_id
            segments.append(Segment("template", tokenizer.convert_ids_to_tokens(bos), (bos,)))
        if picture is not None and end is None:
            segments.append(picture)
        for kind, text in (("context", ctx_text), ("query", query), ("template", end)):
            if text:
                segments.append(Segment(kind, text, _encode(tokenizer, text)))
    return Prompt(tuple(segments), bos_id=getattr(tokenizer, "bos_token_id", None),
                  image=None if image is None else image[1], pixels=pixels)


def check_prompt(prompt: Prompt, absorb: str) -> None:
    """Reject prompts the chosen absorb mode cannot run, with one clear line."""
    if absorb not in ABSORB_MODES:
        raise UserError(f"unknown absorb mode {absorb!r}: use one of {', '.join(ABSORB_MODES)}")
    if not prompt.full_ids:
        raise UserError("the prompt is empty: give a context and/or a query")
    if absorb == "context":
        if not prompt.has_context:
            raise UserError(
                "the context is empty: with absorb 'context' there is nothing to absorb "
                "(give a context, or use absorb 'all')"
            )
        if not any(s.kind == "query" and s.ids and s.text.strip() for s in prompt.segments):
            raise UserError(
                "the query is empty (or only whitespace): with absorb 'context' the patched model "
                "needs query tokens (type a query, or use absorb 'all')"
            )


def reduced_sequence(
    prompt: Prompt, history: Sequence[int], absorb: str, keep_bos: bool = False
) -> tuple[list[int], list[int] | None]:
    """The reduced input ids and their position ids (None for 0..n-1).

    Args:
        prompt: the tokenized prompt.
        history: tokens generated so far (the baseline's, under teacher forcing).
        absorb: "context" or "all".
        keep_bos: with "all", keep BOS at position 0 before the current token.
    """
    if absorb == "all":
        full = list(prompt.full_ids) + list(history)
        current, position = full[-1], len(full) - 1
        if keep_bos and prompt.bos_id is not None and full[0] == prompt.bos_id and position > 0:
            return [prompt.bos_id, current], [0, position]
        return [current], [position]
    return list(prompt.reduced_prompt_ids) + list(history), None
