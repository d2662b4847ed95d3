"""Whether ``sample_shapes`` describe the Trainer's ``train_dataset``, index for index.

The sampler schedules the shapes; the Trainer loads the dataset's items at the same indices. A
table of another file, of the same file in another order, or of another length trains some
samples twice and others never while predicting the wrong costs. The length is always compared;
where the dataset exposes its samples' ids (a ``datasets.Dataset`` with an ``id`` column, a
``sample_ids`` or ``ids`` sequence, or ``records`` / ``data`` / ``list_data_dict`` of mappings
with an ``"id"``, as LLaVA-style datasets hold them), they are compared with the shapes' ids too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dflop_ds.shapes import SampleShape, check_shape_values

#: attributes of a user Dataset that may hold its records (mappings with an "id")
RECORD_ATTRIBUTES = ("records", "data", "list_data_dict")
#: attributes of a user Dataset that may hold its samples' ids
ID_ATTRIBUTES = ("sample_ids", "ids")


def dataset_sample_ids(dataset: Any) -> list[str] | None:
    """The ids of ``dataset``'s samples in index order, as strings, where it exposes them (see the
    module docstring); None where it does not."""
    column_names = getattr(dataset, "column_names", None)
    if isinstance(column_names, list) and "id" in column_names:
        return [str(value) for value in dataset["id"]]
    for name in ID_ATTRIBUTES:
        ids = getattr(dataset, name, None)
        if isinstance(ids, Sequence) and not isinstance(ids, (str, bytes)):
            return [str(value) for value in ids]
    for name in RECORD_ATTRIBUTES:
        records = getattr(dataset, name, None)
        if (
            isinstance(records, Sequence)
            and not isinstance(records, (str, bytes))
            and all(isinstance(r, Mapping) and "id" in r for r in records)
        ):
            return [str(r["id"]) for r in records]
    return None


def check_shapes(shapes: Sequence[SampleShape], dataset: Any) -> None:
    """Refuse shapes that do not cover the dataset index for index: entries that are not valid
    :class:`SampleShape` s (naming the entry), another length, or, where the dataset exposes ids,
    another id at some index (naming the first and how many differ)."""
    check_shape_values(shapes)
    if not hasattr(dataset, "__len__"):
        raise ValueError("DFLOPTrainer needs a train_dataset with a length (not an IterableDataset)")
    if len(dataset) == 0:
        raise ValueError(f"train_dataset ({type(dataset).__name__}) has no samples: there is nothing to train")
    if len(shapes) != len(dataset):
        raise ValueError(
            f"sample_shapes has {len(shapes)} shapes but train_dataset ({type(dataset).__name__}) has"
            f" {len(dataset)} samples: give one SampleShape per dataset index, in index order"
        )
    ids = dataset_sample_ids(dataset)
    if ids is None or len(ids) != len(shapes):
        return
    differ = [i for i, (shape, own) in enumerate(zip(shapes, ids, strict=True)) if shape.sample_id != own]
    if differ:
        first = differ[0]
        raise ValueError(
            f"sample_shapes[{first}] is sample {shapes[first].sample_id!r} but train_dataset[{first}] is"
            f" {ids[first]!r} ({len(differ)} of {len(ids)} indices differ): the shapes were made from another file"
            " or another order of it; make them again from the data the dataset reads (e.g. llava_json_shapes)"
        )


__all__ = ["ID_ATTRIBUTES", "RECORD_ATTRIBUTES", "check_shapes", "dataset_sample_ids"]
