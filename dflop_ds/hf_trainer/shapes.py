"""Sample shapes for a Trainer's dataset, read from the data file and media headers (no pixels)."""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dflop_ds.data import DataError
from dflop_ds.data.errors import PathArg
from dflop_ds.data.formats import shape_reader
from dflop_ds.data.images import open_image
from dflop_ds.models.hf.preprocessor import hf_preprocessor
from dflop_ds.models.hf.registry import processor_family
from dflop_ds.shapes import SampleShape, ShapePolicy


class ShapeTable(list):
    """A ``list[SampleShape]`` that also names the :class:`ShapePolicy` that shaped it, so the
    Trainer can check a cost model against it, and the data file and media folders it was read
    from (None: not from a file), so the Trainer's ranks can check they read the same ones."""

    policy: ShapePolicy

    def __init__(
        self,
        shapes: Iterable[SampleShape],
        policy: ShapePolicy,
        data_path: PathArg | None = None,
        image_folder: PathArg | None = None,
        video_folder: PathArg | None = None,
    ) -> None:
        super().__init__(shapes)
        self.policy = policy
        self.data_path = None if data_path is None else str(data_path)
        self.image_folder = None if image_folder is None else str(image_folder)
        self.video_folder = None if video_folder is None else str(video_folder)


def llava_json_shapes(
    data_path: PathArg,
    model_name_or_path: str,
    *,
    image_folder: PathArg | None = None,
    video_folder: PathArg | None = None,
    max_length: int | None = None,
) -> ShapeTable:
    """One :class:`SampleShape` per record of a LLaVA JSON/JSONL file, in file order (dataset index
    ``i`` is record ``i``), for the HuggingFace model in ``model_name_or_path`` (LLaVA or the
    Qwen2-VL family: its processor decides image tokens and token counts).

    Image sizes come from the files' headers (cached beside the data file), video frame counts
    from their containers; nothing is decoded. Media paths are relative to ``image_folder`` /
    ``video_folder`` (default: the data file's folder). A bad record (a missing image, an unknown
    role, an over-long chat) is a :class:`~dflop_ds.data.DataError` naming the file, record and
    field: the shapes must cover every index of the dataset the Trainer samples from.
    """
    policy = hf_preprocessor(model_name_or_path, max_length=max_length).policy()
    shapes = shape_reader(policy, image_folder, video_folder)(data_path, "error")
    return ShapeTable(shapes, policy, data_path, image_folder, video_folder)


def image_size(image: Any) -> tuple[int, int]:
    """``(width, height)`` of a dataset's image: a PIL image, or an undecoded ``{"bytes", "path"}``
    entry of a ``datasets.Image(decode=False)`` column, read from its header only. Anything else
    (a path string the collator could not load) is a ``ValueError`` naming its type."""
    if hasattr(image, "size") and not isinstance(image, Mapping):
        return tuple(image.size)
    if not isinstance(image, Mapping):
        raise ValueError(
            f"an image given as a {type(image).__name__} ({str(image)[:80]!r}): give PIL images or a datasets.Image"
            " column (cast_column('images', Sequence(Image()))), which TRL's collator can load"
        )
    source = io.BytesIO(image["bytes"]) if image.get("bytes") else image.get("path")
    if source is None:
        raise ValueError("an image entry with neither bytes nor a path")
    with open_image(source) as opened:  # the header; over the pixel limit an OSError (ImageTooLarge)
        return opened.size


def hf_dataset_shapes(dataset: Any, processor: Any) -> ShapeTable:
    """One :class:`SampleShape` per row of a ``datasets.Dataset`` in TRL's vision format (a
    ``messages`` column of chat turns whose contents list ``{"type": "image"}`` and ``{"type":
    "text"}`` parts, and an ``images`` column), for a ``processor`` with a chat template whose
    family (:func:`~dflop_ds.models.hf.registry.processor_family`) gives a policy from a processor
    (LLaVA; another family is refused by name).

    Text tokens are those of the processor's chat template (image placeholders excluded), every
    one supervised, as TRL's vision collator trains them; image sizes come from the images'
    headers (an ``Image`` column is read undecoded). A row the template or the images refuse, or
    whose image parts and images differ in number, is a :class:`~dflop_ds.data.DataError` naming
    its index and field. A row's ``id`` column, when the dataset has one, is its sample id (the
    Trainer compares it with the dataset's); else its index.
    """
    family = processor_family(processor)
    if family.processor_policy is None:
        raise ValueError(
            f"hf_dataset_shapes: the {family.name} family gives no shape policy from a processor yet"
            " (read the data from a LLaVA JSON file with llava_json_shapes, which takes the model directory)"
        )
    policy = family.processor_policy(processor)
    tokenizer = processor.tokenizer
    if getattr(processor, "chat_template", None) is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{type(processor).__name__} has no chat template: TRL renders messages with it")
    rows = _undecoded(dataset)
    image_token = int(processor.image_token_id)
    shapes = []
    for index, row in enumerate(rows):
        images: Sequence[Any] = row.get("images") or []
        try:
            sizes = [image_size(image) for image in images]
        except (OSError, ValueError) as error:
            raise DataError(f"cannot read an image header: {error}", sample_id=str(index), field="images") from error
        markers = image_markers(row["messages"])
        if markers is not None and markers != len(images):
            raise DataError(
                f"row {index}: its messages hold {markers} image parts ({{'type': 'image'}}) but its images column"
                f" {len(images)} images; the processor would refuse it mid-training",
                sample_id=str(index),
                field="images",
            )
        try:
            text = processor.apply_chat_template(row["messages"], tokenize=False)
        except Exception as error:  # noqa: BLE001 - a template error names the row, whatever its type
            raise DataError(f"the chat template refused it: {error}", sample_id=str(index), field="messages") from error
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        text_tokens = sum(1 for token in ids if token != image_token)
        sample_id = str(row["id"]) if "id" in row else str(index)
        shapes.append(policy.shape(sample_id, image_sizes=sizes, text_tokens=text_tokens))
    return ShapeTable(shapes, policy)


def image_markers(messages: Any) -> int | None:
    """The image placeholders (``{"type": "image"}`` parts without an image of their own) of a
    row's chat ``messages`` in TRL's structured format; None for the plain format (every
    ``content`` a string), where TRL inserts one placeholder per image itself."""
    turns = messages if isinstance(messages, Sequence) and not isinstance(messages, str) else []
    contents = [turn.get("content") for turn in turns if isinstance(turn, Mapping)]
    parts = [part for content in contents if isinstance(content, list) for part in content]
    if not parts:
        return None
    placeholders = [part for part in parts if isinstance(part, Mapping) and part.get("type") == "image"]
    return sum(1 for part in placeholders if part.get("image") is None)


def _undecoded(dataset: Any) -> Any:
    """``dataset`` with its ``images`` column left undecoded when it is a ``datasets`` Image column."""
    features = getattr(dataset, "features", None)
    if features is None or "images" not in features:
        return dataset
    import datasets

    column = features["images"]
    inner = getattr(column, "feature", None) or (column[0] if isinstance(column, list) and column else None)
    if isinstance(inner, datasets.Image) and inner.decode:
        return dataset.cast_column("images", datasets.Sequence(datasets.Image(decode=False)))
    return dataset


__all__ = ["ShapeTable", "hf_dataset_shapes", "image_markers", "image_size", "llava_json_shapes"]
