"""Sample shapes: what the encoder and the LLM will see for one training sample.

A :class:`SampleShape` is the only thing the profiler, the planner and the scheduler know about
a sample. It is derived from a dataset record by a :class:`ShapePolicy`, which reproduces how
AnyRes-style MLLMs (LLaVA-NeXT / LLaVA-OneVision, InternVL) cut images into tiles and sample
video frames.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Tokenizer = Callable[[str], int]
#: An image's own encoder units and LLM tokens from its size, for native-resolution models
#: (Qwen2-VL): ``(width, height) -> (encoder_units, visual_tokens)``. Its ``repr`` names it.
ImageRule = Callable[[int, int], tuple[int, int]]
#: A video's encoder units, LLM tokens and encoder units per attention window (a frame group) from
#: its source frames, frame size and frame rate, for models that sample frames by time (Qwen2-VL):
#: ``(frames, width, height, fps) -> (encoder_units, visual_tokens, window_units)``. Its ``repr`` names it.
VideoRule = Callable[[int, int, int, float], tuple[int, int, int]]
#: The encoder tiles and LLM tokens of each image of one sample, from all its images' sizes, for
#: models whose tiling depends on how many images a sample has (LLaVA-OneVision: AnyRes for a lone
#: image, one tile for each of several): ``[(width, height), ...] -> [(tiles, visual_tokens), ...]``.
#: Its ``repr`` names it; the encoder's cost stays counted by tiles.
SampleImagesRule = Callable[[Sequence[tuple[int, int]]], Sequence[tuple[int, int]]]
#: Counts a whole conversation exactly as a model's data pipeline tokenizes it (its length rule
#: included): ``(turns as (role, value) pairs, LLM tokens of each image, LLM tokens of the video or
#: None) -> (text_tokens, label_tokens)``.
ConversationCounter = Callable[[Sequence[tuple[str, str]], Sequence[int], "int | None"], tuple[int, int]]


def length_rule(max_length: int | None, truncation: str) -> str:
    """How a tokenizer identity (``ShapePolicy.tokenizer_id``) spells the sequence-length rule."""
    return f"max_length:{max_length} truncation:{truncation}"


_LENGTH_RULE = re.compile(r"\s*max_length:\S+ truncation:\S+")


def without_length_rule(tokenizer_id: str) -> str:
    """``tokenizer_id`` without its :func:`length_rule`: what fixes the tokens of a given piece of
    text. The length rule decides which lengths occur, not what one of a given length costs."""
    return _LENGTH_RULE.sub("", tokenizer_id)


def split_evenly(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` non-negative ints differing by at most one, the larger ones first."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def default_token_count(text: str) -> int:
    """Estimate the token count of ``text`` without a tokenizer.

    The default is one token per four UTF-8 bytes (rounded up), the usual rule of thumb for
    English BPE vocabularies (GPT-2, LLaMA). Pass a real tokenizer's length function to
    :class:`ShapePolicy` for exact counts.
    """
    return math.ceil(len(text.encode("utf-8")) / 4)


@dataclass(frozen=True)
class SampleShape:
    """The cost-relevant shape of one sample.

    Raw fields come from the dataset; ``encoder_tiles`` and ``llm_tokens`` are derived by a
    :class:`ShapePolicy` (use :meth:`ShapePolicy.shape` rather than filling them by hand).

    Attributes:
        sample_id: the dataset's id for the sample (used in every error message).
        image_sizes: ``(width, height)`` in pixels of each image, in order.
        video_frames: frames in the source video (0 when there is no video).
        video_size: ``(width, height)`` of the video's frames, when known (from its container).
        video_fps: the video's frame rate, when known (from its container).
        text_tokens: text tokens of the whole conversation, placeholders excluded.
        label_tokens: supervised tokens (those the loss is computed on), ``<= text_tokens``.
        encoder_tiles: tiles plus sampled frames the vision encoder processes.
        visual_tokens: tokens the projector inserts into the LLM sequence.
        llm_tokens: LLM sequence length: ``visual_tokens + text_tokens``.
        encoder_attention: the encoder's attention work, the sum over its attention windows of
            the squared units in each (an image's patches, a video's frame group); 0 when the
            policy does not know its windows (tiling policies).
    """

    sample_id: str
    image_sizes: tuple[tuple[int, int], ...] = ()
    video_frames: int = 0
    text_tokens: int = 0
    label_tokens: int = 0
    encoder_tiles: int = 0
    visual_tokens: int = 0
    llm_tokens: int = 0
    video_size: tuple[int, int] | None = None
    video_fps: float | None = None
    encoder_attention: int = 0

    @property
    def modality(self) -> str:
        """One of ``"text"``, ``"image"``, ``"multi_image"``, ``"video"``."""
        if self.video_frames > 0:
            return "video"
        if len(self.image_sizes) > 1:
            return "multi_image"
        if len(self.image_sizes) == 1:
            return "image"
        return "text"


@dataclass(frozen=True)
class ShapePolicy:
    """How pixels and frames become encoder tiles and LLM tokens (AnyRes-style).

    Each image is resized onto the grid of ``tile_size`` tiles (``cols x rows``, at most
    ``max_tiles``) that keeps the most of its resolution while wasting the least canvas, as
    LLaVA-NeXT's best-resolution rule does; a grid of more than one tile also gets a
    downscaled thumbnail tile when ``add_thumbnail`` is set. A video contributes
    ``min(frames, max_frames)`` uniformly sampled frames, each ``units_per_frame`` encoder units
    (one tile by default) giving ``tokens_per_frame`` tokens.

    The defaults take LLaVA-OneVision-SI's sizes at 384 px with SigLIP (729 tokens per tile,
    196 per pooled video frame, 32 frames), but this tiling is an AnyRes-like approximation, not
    that processor: on the single images of ``examples/data`` its tiles agree with
    LLaVA-OneVision's for over 99 % of the sizes, its tokens for none (the processor un-pads the
    grid, adds a newline per feature row, pools large grids and gives each image of a multi-image
    sample one tile). A HuggingFace LLaVA-OneVision directory's own policy counts exactly
    (:mod:`dflop_ds.models.hf.llava_onevision.data`).

    ``name`` labels the policy in messages; ``tokenizer_id`` names the tokenizer (and chat
    template) that counts the text, for :meth:`describe` (default: the ``tokenizer``
    function's qualified name). ``conversation``, when set, counts a LLaVA conversation as
    a whole (template, separators, image placeholders), replacing the per-turn counting.
    ``image_rule``, when set, replaces the tiling: every image gives the encoder units (e.g.
    patches) and LLM tokens the rule derives from its own size (native-resolution models such as
    Qwen2-VL; ``encoder_tiles`` then counts those units). ``video_rule``, when set, does the same
    for a video from its frames, size and frame rate (which its shape must then carry).
    ``sample_images``, when set, replaces the tiling by a rule over all of a sample's images
    (:data:`SampleImagesRule`); ``tokens_per_video`` adds that many tokens to each video besides
    its frames' (LLaVA-OneVision's closing newline).
    """

    tile_size: int = 384
    max_tiles: int = 9
    add_thumbnail: bool = True
    tokens_per_tile: int = 729
    max_frames: int = 32
    tokens_per_frame: int = 196
    tokenizer: Tokenizer = field(default=default_token_count, compare=False, repr=False)
    name: str = field(default="custom", compare=False)
    tokenizer_id: str | None = None
    conversation: ConversationCounter | None = field(default=None, compare=False, repr=False)
    image_rule: ImageRule | None = field(default=None, compare=False, repr=False)
    video_rule: VideoRule | None = field(default=None, compare=False, repr=False)
    sample_images: SampleImagesRule | None = field(default=None, compare=False, repr=False)
    tokens_per_video: int = 0
    units_per_frame: int = 1

    def __post_init__(self) -> None:
        for name in ("tile_size", "max_tiles", "tokens_per_tile", "max_frames", "tokens_per_frame", "units_per_frame"):
            if getattr(self, name) < 1:
                raise ValueError(f"ShapePolicy.{name} must be >= 1, got {getattr(self, name)}")
        if self.tokens_per_video < 0:
            raise ValueError(f"ShapePolicy.tokens_per_video must be >= 0, got {self.tokens_per_video}")

    def describe(self) -> dict[str, Any]:
        """What the shapes depend on, JSON-ready: ``name``, the tiling and token numbers, and
        ``tokenizer`` (its identity). Two policies with equal descriptions but for ``name``
        derive the same shapes."""
        tokenizer = (
            self.tokenizer_id
            or f"{getattr(self.tokenizer, '__module__', '?')}."
            f"{getattr(self.tokenizer, '__qualname__', type(self.tokenizer).__name__)}"
        )
        described = {
            "name": self.name,
            "tile_size": self.tile_size,
            "max_tiles": self.max_tiles,
            "add_thumbnail": self.add_thumbnail,
            "tokens_per_tile": self.tokens_per_tile,
            "max_frames": self.max_frames,
            "tokens_per_frame": self.tokens_per_frame,
            "tokenizer": tokenizer,
        }
        if self.image_rule is not None:
            described["image_rule"] = repr(self.image_rule)
        if self.video_rule is not None:
            described["video_rule"] = repr(self.video_rule)
        if self.sample_images is not None:
            described["sample_images"] = repr(self.sample_images)
        if self.tokens_per_video:
            described["tokens_per_video"] = self.tokens_per_video
        if self.units_per_frame != 1:
            described["units_per_frame"] = self.units_per_frame
        return described

    def image_units(self, width: int, height: int) -> tuple[int, int]:
        """``(encoder units, LLM tokens)`` of one image: its tiles and their tokens, or the ``image_rule``'s."""
        if self.image_rule is not None:
            if width <= 0 or height <= 0:
                raise ValueError(f"image size must be positive, got {width}x{height}")
            units, tokens = self.image_rule(width, height)
            return int(units), int(tokens)
        tiles = self.image_tiles(width, height)
        return tiles, tiles * self.tokens_per_tile

    def images_units(self, sizes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """``(encoder units, LLM tokens)`` of each image of one sample (``(width, height)`` each):
        the ``sample_images`` rule's, else each image's own (:meth:`image_units`)."""
        if self.sample_images is None or not sizes:
            return [self.image_units(w, h) for w, h in sizes]
        if any(w <= 0 or h <= 0 for w, h in sizes):
            raise ValueError(f"image sizes must be positive, got {list(sizes)}")
        units = [(int(tiles), int(tokens)) for tiles, tokens in self.sample_images(sizes)]
        if len(units) != len(sizes):
            raise ValueError(
                f"policy {self.name!r}: its sample_images rule gave {len(units)} counts for {len(sizes)} images"
            )
        return units

    def tile_grid(self, width: int, height: int) -> tuple[int, int]:
        """The ``(cols, rows)`` tile grid chosen for an image of ``width x height`` pixels."""
        if width <= 0 or height <= 0:
            raise ValueError(f"image size must be positive, got {width}x{height}")
        best: tuple[int, int] = (1, 1)
        best_key: tuple[float, float] = (-1.0, 0.0)
        for cols in range(1, self.max_tiles + 1):
            for rows in range(1, self.max_tiles // cols + 1):
                canvas_w, canvas_h = cols * self.tile_size, rows * self.tile_size
                scale = min(canvas_w / width, canvas_h / height)
                kept = min(width * scale * height * scale, width * height)
                wasted = canvas_w * canvas_h - kept
                key = (kept, -wasted)
                if key > best_key:
                    best, best_key = (cols, rows), key
        return best

    def image_tiles(self, width: int, height: int) -> int:
        """Tiles the encoder sees for one image, the thumbnail included."""
        cols, rows = self.tile_grid(width, height)
        grid = cols * rows
        return grid + 1 if grid > 1 and self.add_thumbnail else grid

    def video_units(
        self, sample_id: str, frames: int, size: tuple[int, int] | None, fps: float | None
    ) -> tuple[int, int, int]:
        """``(encoder units, LLM tokens, attention units)`` of a video of ``frames`` source frames: its
        sampled frames and their tokens (attention unknown: 0), or the ``video_rule``'s (which needs
        the frame size and rate; attention: units x units per window)."""
        if frames == 0:
            return 0, 0, 0
        if self.video_rule is None:
            sampled = self.sampled_frames(frames)
            return sampled * self.units_per_frame, sampled * self.tokens_per_frame + self.tokens_per_video, 0
        if size is None or fps is None:
            raise ValueError(
                f"sample {sample_id!r}: policy {self.name!r} needs the video's frame size and rate "
                "(read from the video file under a video_folder)"
            )
        units, tokens, window = self.video_rule(int(frames), int(size[0]), int(size[1]), float(fps))
        return int(units), int(tokens), int(units) * int(window)

    def sampled_frames(self, video_frames: int) -> int:
        """Frames sampled from a video of ``video_frames`` frames."""
        if video_frames < 0:
            raise ValueError(f"video_frames must be >= 0, got {video_frames}")
        return min(video_frames, self.max_frames)

    def count_tokens(self, text: str) -> int:
        """Text tokens of ``text`` by this policy's tokenizer."""
        return int(self.tokenizer(text))

    def shape(
        self,
        sample_id: str,
        *,
        image_sizes: Sequence[tuple[int, int]] = (),
        video_frames: int = 0,
        text_tokens: int = 0,
        label_tokens: int | None = None,
        video_size: tuple[int, int] | None = None,
        video_fps: float | None = None,
    ) -> SampleShape:
        """Build the :class:`SampleShape` of one sample, deriving tiles and LLM tokens.

        ``label_tokens`` defaults to ``text_tokens`` (every text token supervised).
        """
        if text_tokens < 0:
            raise ValueError(f"sample {sample_id!r}: text_tokens must be >= 0, got {text_tokens}")
        labels = text_tokens if label_tokens is None else label_tokens
        if not 0 <= labels <= text_tokens:
            raise ValueError(
                f"sample {sample_id!r}: label_tokens must be in [0, text_tokens={text_tokens}], got {labels}"
            )
        sizes = tuple((int(w), int(h)) for w, h in image_sizes)
        per_image = self.images_units(sizes)
        image_tiles = sum(units for units, _ in per_image)
        if video_frames < 0:
            raise ValueError(f"sample {sample_id!r}: video_frames must be >= 0, got {video_frames}")
        frames, video_tokens, video_attention = self.video_units(
            str(sample_id), int(video_frames), video_size, video_fps
        )
        visual = sum(tokens for _, tokens in per_image) + video_tokens
        # an image under an image_rule is one attention window; tiles' windows are not known here
        image_attention = sum(units**2 for units, _ in per_image) if self.image_rule is not None else 0
        return SampleShape(
            sample_id=str(sample_id),
            image_sizes=sizes,
            video_frames=int(video_frames),
            text_tokens=int(text_tokens),
            label_tokens=int(labels),
            encoder_tiles=image_tiles + frames,
            visual_tokens=visual,
            llm_tokens=visual + int(text_tokens),
            video_size=None if video_size is None else (int(video_size[0]), int(video_size[1])),
            video_fps=None if video_fps is None else float(video_fps),
            encoder_attention=image_attention + video_attention,
        )

    def reshape(self, shape: SampleShape) -> SampleShape:
        """Re-derive ``shape`` under this policy (e.g. a manifest read with another policy)."""
        return self.shape(
            shape.sample_id,
            image_sizes=shape.image_sizes,
            video_frames=shape.video_frames,
            text_tokens=shape.text_tokens,
            label_tokens=shape.label_tokens,
            video_size=shape.video_size,
            video_fps=shape.video_fps,
        )


#: The policy of the bundled tiny MLLM: real AnyRes tiling of real image sizes, but few
#: tokens per tile so that CPU training stays fast.
TINY_POLICY = ShapePolicy(
    tile_size=336, max_tiles=4, tokens_per_tile=16, max_frames=8, tokens_per_frame=16, name="tiny"
)
#: The default policy, by name: AnyRes-like tiling with LLaVA-OneVision's sizes (an approximation,
#: see :class:`ShapePolicy`).
DEFAULT_POLICY = ShapePolicy(name="default")


#: the counts of a :class:`SampleShape` that must be finite and >= 0
SHAPE_COUNTS = (
    "text_tokens",
    "label_tokens",
    "encoder_tiles",
    "visual_tokens",
    "llm_tokens",
    "video_frames",
    "encoder_attention",
)


def check_shape_values(shapes: Sequence[Any], source: str = "sample_shapes") -> None:
    """Refuse, naming the entry of ``source`` and the sample, a table that is not one
    :class:`SampleShape` per entry (a dict, a tuple) or whose counts (:data:`SHAPE_COUNTS`) are
    not numbers, or are negative, NaN or infinite: a sampler would otherwise fail mid-epoch on a
    cost it cannot order, or train on it in silence."""
    if not all(isinstance(shape, SampleShape) for shape in shapes):
        index, shape = next((i, s) for i, s in enumerate(shapes) if not isinstance(s, SampleShape))
        raise TypeError(
            f"{source}[{index}] is a {type(shape).__name__}, not a SampleShape: build shapes with a"
            " ShapePolicy (policy.shape(sample_id, image_sizes=..., text_tokens=...)) or SampleShape(...)"
        )
    if not shapes:
        return
    bad: list[tuple[int, int]] = []
    for column, name in enumerate(SHAPE_COUNTS):
        values = [getattr(shape, name) for shape in shapes]
        counts = np.asarray(values)
        if counts.dtype.kind in "iuf":  # every value a number: one vectorized check
            bad += [(int(row), column) for row in np.flatnonzero(~np.isfinite(counts) | (counts < 0))]
        else:  # some value is not a number: find it among the values as given
            bad += [(row, column) for row, value in enumerate(values) if not _is_count(value)]
    if bad:
        index, column = min(bad)
        name = SHAPE_COUNTS[column]
        more = len({r for r, _ in bad}) - 1
        raise ValueError(
            f"{source}[{index}] (sample {shapes[index].sample_id!r}): {name}={getattr(shapes[index], name)!r} is not"
            " a finite count >= 0" + (f" ({more} more such samples)" if more else "")
        )


def _is_count(value: Any) -> bool:
    """Whether ``value`` is a finite real number >= 0 (not a bool, not a string)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    number = float(value)
    return math.isfinite(number) and number >= 0
