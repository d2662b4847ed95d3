"""A checkpoint's own chat template: a conversation's token ids and its assistant-only labels.

A checkpoint that ships a ``chat_template`` (its processor's or its tokenizer's Jinja text) is
tokenized the way TRL and the Trainer examples do it: the conversation is rendered with the
template (every turn's content a list of ``{"type": "text" | "image" | "video"}`` items, as
processors pass it), the whole text is tokenized at once (no special tokens added: the template
writes them), and each image's or video's marker token is expanded into the family's block of
visual tokens, as the family's processor expands it.

**Labels** are the assistant turns' tokens, found by rendering the conversation prefix by prefix:
an assistant turn's text is what rendering the conversation up to and including it adds to the
rendering of the turns before it with the generation prompt (the template's assistant header),
trailing whitespace excluded. A token is supervised when its characters overlap such a text.
This needs only that a template renders a conversation's earlier turns the same whatever follows
them (true of the LLaVA, ChatML, Qwen2-VL and InternVL templates); a template that does not is
refused by name. A fast tokenizer is needed (its offsets map tokens to characters).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dflop_ds.data.errors import PathArg
from dflop_ds.data.llava import PLACEHOLDERS

logger = logging.getLogger(__name__)

IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER = PLACEHOLDERS
#: Conversations (normalized turns) on which a checkpoint's template is compared with the built-in
#: one: images before, inside and after text, answers that start with a space, a digit or
#: punctuation and hold newlines, several rounds, and a video.
PROBES: tuple[tuple[tuple[str, str], ...], ...] = (
    (("user", "<image>\nWhat is shown in the picture?"), ("assistant", "A red car, parked near the sea.")),
    (
        ("user", "hi"),
        ("assistant", " 42 times\nsure!"),
        ("user", "compare <image> and <image>\n"),
        ("assistant", "...the first one."),
    ),
    (("user", "<video>\ndescribe it"), ("assistant", "a dog runs (fast)")),
)
#: one encoding: ``(turns, image blocks, video block) -> (input_ids, supervised)``
Encoder = Callable[[Sequence[tuple[str, str]], Sequence[list[int]], "list[int] | None"], tuple[list[int], list[bool]]]
#: the processor file an older ``save_pretrained`` wrote its chat template to
LEGACY_TEMPLATE_FILE = "chat_template.json"


def checkpoint_chat_template(*holders: Any, model_dir: PathArg | None = None) -> str | None:
    """The chat template a checkpoint ships: the first of ``holders`` (processor, then tokenizer)
    that has one, else the one in ``model_dir``'s legacy ``chat_template.json``; None when none does.
    A holder with several named templates gives its ``"default"`` one."""
    for holder in holders:
        template = getattr(holder, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default")
        if isinstance(template, str) and template.strip():
            return template
    legacy = None if model_dir is None else Path(model_dir) / LEGACY_TEMPLATE_FILE
    if legacy is not None and legacy.is_file():
        try:
            saved = json.loads(legacy.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"{legacy}: not a JSON chat template file ({exc})") from exc
        template = saved.get("chat_template") if isinstance(saved, dict) else None
        if isinstance(template, str) and template.strip():
            return template
    return None


def template_identity(source: str) -> str:
    """How a shape policy's identity names a chat template: ``chat_template:<digest of its text>``."""
    return f"chat_template:{hashlib.sha256(source.encode('utf-8')).hexdigest()[:12]}"


def turn_content(value: str) -> list[dict[str, str]]:
    """A turn's text as processor-style content items: ``<image>`` / ``<video>`` placeholders become
    ``{"type": "image"}`` / ``{"type": "video"}``, the text between them ``{"type": "text"}`` items."""
    items = []
    for part in re.split(f"({IMAGE_PLACEHOLDER}|{VIDEO_PLACEHOLDER})", value):
        if part == IMAGE_PLACEHOLDER:
            items.append({"type": "image"})
        elif part == VIDEO_PLACEHOLDER:
            items.append({"type": "video"})
        elif part:
            items.append({"type": "text", "text": part})
    return items


class ModelChatTemplate:
    """A checkpoint's chat template bound to its tokenizer and the marker tokens the template writes
    for an image (``image_marker``) and a video (``video_marker``; None: the family takes none).

    Raises:
        ValueError: the tokenizer is not a fast one (no offsets), naming ``name``.
    """

    def __init__(self, source: str, tokenizer: Any, image_marker: int, video_marker: int | None, name: str) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                f"{name}: the checkpoint's chat template needs a fast tokenizer (token offsets find the "
                f"assistant turns), but {type(tokenizer).__name__} is not one"
            )
        self.source, self.tokenizer, self.name = source, tokenizer, name
        self.image_marker, self.video_marker = int(image_marker), video_marker
        self.identity = template_identity(source)
        warn_without_generation_prompt(self)

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        """The template's text of ``messages`` (with the assistant header after them when ``generation_prompt``).

        Raises:
            ValueError: the template fails on them (it raised, e.g. on roles that do not alternate).
        """
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=self.source, tokenize=False, add_generation_prompt=generation_prompt
            )
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError, RecursionError) as exc:
            detail = str(exc) if isinstance(exc, TemplateError) else f"{type(exc).__name__}: {exc}"
            raise ValueError(
                f"{self.name}: the checkpoint's chat template fails on this conversation: {detail}"
            ) from exc
        return str(text)

    def messages(self, turns: Sequence[tuple[str, str]], system: str | None) -> list[dict[str, Any]]:
        """Processor-style messages of ``(user|assistant, value)`` turns, after a system message when ``system``."""
        head = [] if system is None else [{"role": "system", "content": [{"type": "text", "text": system}]}]
        return head + [{"role": role, "content": turn_content(value)} for role, value in turns]

    def rendered(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The text of ``messages`` and the ``[start, end)`` character span of every assistant turn.

        Raises:
            ValueError: the template renders earlier turns differently once later ones follow.
        """
        text = self.render(messages)
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            upto = self.render(messages[: k + 1])
            before = self.render(messages[:k], generation_prompt=True)
            if not upto.startswith(before):
                before = self.render(messages[:k])  # the generation prompt is not how it writes the turn
            if not upto.startswith(before) or not text.startswith(upto):
                raise ValueError(
                    f"{self.name}: the checkpoint's chat template renders turn {k} differently once later "
                    "turns follow, so its assistant tokens cannot be found (pass chat_template=False to use "
                    "the built-in template)"
                )
            spans.append((len(before), len(upto.rstrip())))
        return text, spans

    def encode(
        self,
        turns: Sequence[tuple[str, str]],
        image_blocks: Sequence[list[int]],
        video_block: list[int] | None,
        system: str | None = None,
    ) -> tuple[list[int], list[bool]]:
        """``(input_ids, supervised)`` of ``(user|assistant, value)`` turns, each image's marker
        replaced by its block of ``image_blocks`` (in order) and the video's by ``video_block``, after
        a ``system`` message when one is given (else the template's own, if any).

        Raises:
            ValueError: the template writes another number of markers than there are images or
                videos, or renders earlier turns differently once later ones follow.
        """
        if video_block is not None and self.video_marker is None:
            raise ValueError(f"{self.name}: no video marker token for the checkpoint's chat template")
        text, spans = self.rendered(self.messages(turns, system))
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        markers = {
            self.image_marker: list(image_blocks),
            self.video_marker: [] if video_block is None else [video_block],
        }
        found = {token: 0 for token in markers}
        ids: list[int] = []
        supervised: list[bool] = []
        for token, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"]):
            if token in markers:
                blocks, found[token] = markers[token], found[token] + 1
                block = blocks[found[token] - 1] if found[token] <= len(blocks) else []
                ids.extend(block)
                supervised.extend([False] * len(block))
                continue
            ids.append(int(token))
            supervised.append(any(start < b and end > a for a, b in spans))
        for token, blocks in markers.items():
            if token is not None and found[token] != len(blocks):
                kind = "image" if token == self.image_marker else "video"
                raise ValueError(
                    f"conversations: the checkpoint's chat template writes {found[token]} {kind} marker(s) "
                    f"({self.tokenizer.convert_ids_to_tokens(token)!r}) for {len(blocks)} {kind}(s)"
                )
        return ids, supervised


def warn_without_generation_prompt(template: ModelChatTemplate) -> bool:
    """Warn (and return True) when ``template`` writes nothing for ``add_generation_prompt``: each
    assistant turn's header is then found inside the turn and supervised with the answer."""
    question = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    try:
        silent = template.render(question, generation_prompt=True) == template.render(question)
    except ValueError:
        return False  # a template that fails here is named when it renders a record
    if silent:
        logger.warning(
            "%s: the checkpoint's chat template writes no generation prompt (add_generation_prompt adds nothing),"
            " so each assistant turn's header is supervised as part of its answer; give the template a"
            " generation prompt to train on the answers alone",
            template.name,
        )
    return silent


def encode_alike(
    template: Encoder,
    builtin: Encoder,
    image_block: Callable[[int], list[int]],
    video_block: Callable[[int], list[int]] | None,
) -> bool:
    """Whether ``template`` and ``builtin`` give the same ids and labels on every conversation of
    :data:`PROBES` (the video one only when ``video_block``): a checkpoint template that does
    tokenizes as the built-in template, so its shape policy keeps the built-in one's identity.
    An encoding that fails counts as different."""
    for turns in PROBES:
        has_video = any(VIDEO_PLACEHOLDER in value for _, value in turns)
        if has_video and video_block is None:
            continue
        images = [image_block(3 + i) for i in range(sum(value.count(IMAGE_PLACEHOLDER) for _, value in turns))]
        video = video_block(4) if has_video and video_block is not None else None
        try:
            if template(turns, images, video) != builtin(turns, images, video):
                return False
        except (ValueError, TypeError):
            return False
    return True


__all__ = [
    "PROBES",
    "ModelChatTemplate",
    "encode_alike",
    "checkpoint_chat_template",
    "template_identity",
    "turn_content",
    "warn_without_generation_prompt",
]
