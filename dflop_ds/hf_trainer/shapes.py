"""Sample shapes for a Trainer's dataset, read from the data file and media headers (no pixels)."""

from __future__ import annotations

from pathlib import Path

from dflop_ds.data import read_dataset
from dflop_ds.data.errors import PathArg
from dflop_ds.models.hf.source import hf_policy
from dflop_ds.shapes import SampleShape


def llava_json_shapes(
    data_path: PathArg,
    model_name_or_path: str,
    *,
    image_folder: PathArg | None = None,
    video_folder: PathArg | None = None,
    max_length: int | None = None,
) -> list[SampleShape]:
    """One :class:`SampleShape` per record of a LLaVA JSON/JSONL file, in file order (dataset index
    ``i`` is record ``i``), for the HuggingFace model in ``model_name_or_path`` (LLaVA or the
    Qwen2-VL family: its processor decides image tokens and token counts).

    Image sizes come from the files' headers (cached beside the data file), video frame counts
    from their containers; nothing is decoded. Media paths are relative to ``image_folder`` /
    ``video_folder`` (default: the data file's folder). A bad record (a missing image, an unknown
    role, an over-long chat) is a :class:`~dflop_ds.data.DataError` naming the file, record and
    field: the shapes must cover every index of the dataset the Trainer samples from.
    """
    folder = str(Path(data_path).parent)
    return list(
        read_dataset(
            data_path,
            hf_policy(model_name_or_path, max_length=max_length),
            image_folder=str(image_folder) if image_folder is not None else folder,
            video_folder=str(video_folder) if video_folder is not None else folder,
        )
    )


__all__ = ["llava_json_shapes"]
