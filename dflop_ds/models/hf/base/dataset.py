"""The media dataset every HF family shares: shapes + records -> contract items, stand-ins for
samples whose media fail (``on_bad_sample="skip"``), and the records of a LLaVA-format JSON file.

A family subclass says whether its model takes videos and how an item's media become tensors; the
padded and packed collates are in :mod:`~dflop_ds.models.hf.base.collate`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

from dflop_ds.data.errors import DataError, PathArg
from dflop_ds.data.images import load_rgb
from dflop_ds.data.media import image_field, record_image_paths, recorded_size_source, size_mismatch
from dflop_ds.data.records import check_policy, load_records
from dflop_ds.data.video import decode_frames, sample_frame_indices
from dflop_ds.models.hf.base.template import Encoded, TemplatePreprocessor
from dflop_ds.models.tiny_data import IGNORE_INDEX
from dflop_ds.shapes import SampleShape

logger = logging.getLogger(__name__)

#: processes whose stand-ins a dataset counts apart (the loading process and up to this many
#: minus one DataLoader workers; more workers share slots, and may then miss a count)
STAND_IN_SLOTS = 257


def supervised_targets(shape: SampleShape) -> int:
    """Targets (non -100 entries) :class:`MediaDataset` makes for ``shape``: its ``label_tokens``
    (the sampler's ``label_tokens_fn`` for shapes of a family preprocessor's ``policy()``)."""
    return shape.label_tokens


def load_llava_records(path: PathArg) -> dict[str, Mapping[str, Any]]:
    """The records of a LLaVA JSON/JSONL file by id (as a string); records without one are left out."""
    records = {}
    for raw in load_records(path):
        if isinstance(raw.value, Mapping) and isinstance(raw.value.get("id"), (str, int)):
            records[str(raw.value["id"])] = raw.value
    return records


@dataclass
class MediaItem:
    """One sample: ``pixel_values [n_img, C, H, W]``, ``input_ids [L]``, shifted ``targets [L]``."""

    sample_id: str
    pixel_values: torch.Tensor
    input_ids: torch.Tensor
    targets: torch.Tensor
    pad_token_id: int
    loss_denominator: float | None = None


class MediaDataset(Dataset):
    """The samples of ``shapes`` (made under ``preprocessor.policy()``) as contract tensors.

    A sample whose media cannot be loaded (a missing, truncated or corrupt file, an image over the
    pixel limit) is a :class:`~dflop_ds.data.errors.DataError` naming the record, the field and the
    file. With ``on_bad_sample="skip"`` it becomes a *stand-in* instead: the same tensor shapes,
    blank pixels, the same token ids and no targets, logged by name and counted
    (:attr:`stand_in_count`). The schedule was built before any file was decoded, so dropping the
    sample here would leave this rank a microbatch short of the others and desynchronise every
    collective; the stand-in keeps all ranks in lockstep and leaves every other sample trained
    exactly once. It has no loss term of its own, but its ``d`` label tokens stay in the loss
    denominator ``D`` the schedule fixed for its global batch, so that step's loss and gradient
    are those of the other samples scaled by ``(D - d) / D``.

    Args:
        shapes: one shape per sample, in dataset order (e.g. ``read_dataset(...)[:n]``).
        records: the raw records by id (:func:`load_llava_records`).
        preprocessor: the model directory's preprocessor
            (a :class:`~dflop_ds.models.hf.base.template.TemplatePreprocessor`).
        image_folder: folder the records' image paths are relative to.
        source: the data file, for messages.
        video_folder: folder the records' video paths are relative to (families that take videos).
        on_bad_sample: ``"error"`` (default): a sample whose media fail to load raises;
            ``"skip"``: it is trained as a stand-in (above) and counted in :attr:`stand_in_count`.
    """

    #: whether the family's model takes videos (a sample with one is refused by name when not)
    supports_video = False
    #: whether an image's size changes the sample's tokens, so a recorded size must match the file
    #: (a family that resizes every image to one tile leaves it False)
    size_sets_tokens = False

    def __init__(
        self,
        shapes: Sequence[SampleShape],
        records: Mapping[str, Mapping[str, Any]],
        preprocessor: TemplatePreprocessor,
        image_folder: PathArg | None,
        *,
        source: PathArg | None = None,
        video_folder: PathArg | None = None,
        on_bad_sample: str = "error",
    ) -> None:
        check_policy(on_bad_sample)
        self.shapes = list(shapes)
        self.records = records
        self.preprocessor = preprocessor
        self.image_folder = None if image_folder is None else Path(image_folder)
        self.video_folder = None if video_folder is None else Path(video_folder)
        self.source = source
        self.on_bad_sample = on_bad_sample
        # stand-ins made per process, in shared memory so that the training process reads what its
        # DataLoader workers made: slot 0 for the process itself, slot 1 + k for worker k (one writer each)
        self._stand_ins = torch.zeros(STAND_IN_SLOTS, dtype=torch.long).share_memory_()
        for shape in self.shapes:
            if shape.sample_id not in records:
                raise self._error(shape.sample_id, None, "no record with this id in the records given")
            if shape.video_frames and not self.supports_video:
                raise self._error(shape.sample_id, "video", f"videos are not supported by {preprocessor.name}")
            if shape.image_sizes and self.image_folder is None:
                raise self._error(shape.sample_id, "image", "the sample has images but no image_folder was given")
            if shape.video_frames and self.video_folder is None:
                raise self._error(shape.sample_id, "video", "the sample has a video but no video_folder was given")

    @property
    def stand_in_count(self) -> int:
        """Stand-ins made so far by this dataset in this process and its DataLoader workers
        (prefetched ones not yet trained included)."""
        return int(self._stand_ins.sum())

    def _error(self, sample_id: str, field: str | None, reason: str) -> DataError:
        return DataError(reason, path=self.source, sample_id=sample_id, field=field)

    def _tensors(self, shape: SampleShape, encode: Callable[[], Encoded]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, targets)`` of the sample of ``shape`` as ``encode()`` encodes it; a failed
        encoding, or one that disagrees with the shape, raises naming the sample."""
        try:
            return item_tensors(encode(), shape, self.preprocessor.name)
        except ValueError as exc:
            raise self._error(shape.sample_id, None, str(exc)) from exc

    def __len__(self) -> int:
        return len(self.shapes)

    def _load_images(self, shape: SampleShape) -> list:
        """The sample's images, decoded as 8-bit RGB; one that cannot be loaded, or (when
        :attr:`size_sets_tokens`) whose size is not the one its shape was made with, raises naming
        the record, the field and the file."""
        record = self.records[shape.sample_id]
        images = []
        for i, path in enumerate(record_image_paths(record)):
            full = os.path.abspath(os.path.join(self.image_folder, path))  # type: ignore[arg-type]
            field = image_field(record, i)
            try:
                image = load_rgb(full)
            except (OSError, ValueError) as exc:
                raise self._error(shape.sample_id, field, f"cannot load image {full}: {exc}") from exc
            if self.size_sets_tokens and tuple(image.size) != tuple(shape.image_sizes[i]):
                size_field, given_by = recorded_size_source(record, i)  # the error names where the size came from
                reason = size_mismatch(given_by, shape.image_sizes[i], path, full, image.size)
                raise self._error(shape.sample_id, size_field, reason)
            images.append(image)
        return images

    def _uniform_frames(self, shape: SampleShape, count: int) -> list:
        """``count`` frames sampled uniformly from the sample's video, decoded (PyAV); a video that
        cannot be loaded raises naming the record and the file."""
        path = self.records[shape.sample_id]["video"]
        full = os.path.abspath(os.path.join(self.video_folder, path))  # type: ignore[arg-type]
        try:
            return decode_frames(full, sample_frame_indices(shape.video_frames, count))
        except (OSError, ValueError) as exc:
            raise self._error(shape.sample_id, "video", f"cannot load video {full}: {exc}") from exc

    def _turns(self, shape: SampleShape) -> list[tuple[str, str]]:
        return [(turn["from"], turn["value"]) for turn in self.records[shape.sample_id]["conversations"]]

    def _shape(self, idx: Any) -> SampleShape:
        i = int(idx)
        if not 0 <= i < len(self.shapes):
            raise IndexError(f"{type(self).__name__} index {i} out of range [0, {len(self.shapes)})")
        return self.shapes[i]

    def _item(self, shape: SampleShape, blank: bool) -> MediaItem:
        """The sample of ``shape`` with its media loaded, or (``blank``) with blank pixels of the same shape."""
        n_images = len(shape.image_sizes)
        ids, targets = self._tensors(shape, lambda: self.preprocessor.encode(self._turns(shape), n_images))
        if blank:
            pixels = torch.zeros((n_images, *self.preprocessor.pixel_shape), dtype=torch.float32)
        else:
            pixels = self.preprocessor.pixel_values(self._load_images(shape))
        return MediaItem(shape.sample_id, pixels, ids, targets, self.preprocessor.pad_token_id)

    def _stand_in(self, shape: SampleShape, error: DataError) -> MediaItem:
        """The stand-in of a sample whose media failed with ``error`` (re-raised when the sample's
        text cannot be encoded either)."""
        try:
            item = self._item(shape, blank=True)
        except (DataError, ValueError):
            raise error from None
        item.targets = torch.full_like(item.targets, IGNORE_INDEX)
        worker = get_worker_info()
        self._stand_ins[0 if worker is None else 1 + worker.id % (STAND_IN_SLOTS - 1)] += 1
        logger.warning(
            "%s; on_bad_sample=skip: trained as a stand-in with blank media and no targets (its labels stay in"
            " the step's loss denominator)",
            error,
        )
        return item

    def __getitem__(self, idx: Any) -> MediaItem:
        """The sample at ``idx`` (an ``int`` or a ``ScheduledIndex``, whose denominator is kept)."""
        shape = self._shape(idx)
        try:
            item = self._item(shape, blank=False)
        except DataError as error:
            if self.on_bad_sample != "skip":
                raise
            item = self._stand_in(shape, error)
        item.loss_denominator = scheduled_denominator(idx)
        return item


def scheduled_denominator(idx: Any) -> float | None:
    """The loss denominator a ``ScheduledIndex`` carries, or None for a plain index."""
    denominator = getattr(idx, "loss_denominator", None)
    return None if denominator is None else float(denominator)


def item_tensors(encoded: Encoded, shape: SampleShape, policy_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, targets)`` of an encoded sample, targets already shifted (-100 where nothing is
    predicted); raises ``ValueError`` when the encoding disagrees with the sample's shape (the
    shapes were made under another policy, so the sampler's loss denominator would be wrong)."""
    if len(encoded.input_ids) != shape.llm_tokens or encoded.label_count != shape.label_tokens:
        raise ValueError(
            f"encodes to {len(encoded.input_ids)} tokens with {encoded.label_count} targets, but its shape "
            f"says {shape.llm_tokens} and {shape.label_tokens}: the shapes were made under another policy "
            f"than {policy_name!r}"
        )
    ids = torch.tensor(encoded.input_ids, dtype=torch.long)
    targets = torch.full_like(ids, IGNORE_INDEX)
    supervised = torch.tensor(encoded.supervised[1:], dtype=torch.bool)
    targets[:-1][supervised] = ids[1:][supervised]
    return ids, targets


__all__ = [
    "MediaDataset",
    "MediaItem",
    "item_tensors",
    "load_llava_records",
    "scheduled_denominator",
    "supervised_targets",
]
