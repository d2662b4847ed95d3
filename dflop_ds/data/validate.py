"""Validate a whole dataset file and report every problem, not only the first.

Checks, for a shape manifest or a LLaVA file: the file can be read and parsed; every record
is a JSON object with the right fields of the right types; sizes, frame counts and token counts
are positive and plausible (image sides <= 100000 px, frames <= 10^7); ids are unique; every
image has a size (record, side table, image header or an explicit fallback) and, with an image
folder, exists and is readable; media files decode in full (all of them with ``decode=None``,
``dflop-ds validate --deep``; by default a few spread over the file, :mod:`dflop_ds.data.decode`);
and, when caps are given, no sample is larger than the model can take (``max_llm_tokens``,
``max_encoder_tiles``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from dflop_ds.data.decode import SAMPLED_DECODES, decode_media, media_files, spread
from dflop_ds.data.errors import DataError, PathArg, describe_location
from dflop_ds.data.formats import LLAVA, detect_format, read_loaded
from dflop_ds.data.media import MediaOptions
from dflop_ds.data.records import ReadResult, load_records
from dflop_ds.data.sizes import load_frame_table, load_size_table
from dflop_ds.shapes import DEFAULT_POLICY, ShapePolicy


@dataclass(frozen=True)
class Problem:
    """One problem found in a dataset: where (file, record, id, field) and what."""

    path: str | None
    record: int | None
    record_kind: str
    sample_id: str | None
    field: str | None
    message: str

    @classmethod
    def from_error(cls, error: DataError) -> Problem:
        """The problem a :class:`DataError` describes."""
        return cls(error.path, error.record, error.record_kind, error.sample_id, error.field, error.reason)

    def __str__(self) -> str:
        return (
            f"{describe_location(self.path, self.record, self.record_kind, self.sample_id, self.field)}: {self.message}"
        )


def _load_table(loader, table, problems: list[Problem]) -> dict:
    """A side table, or an empty one after recording why it could not be loaded."""
    try:
        return loader(table)
    except DataError as error:
        problems.append(Problem.from_error(error))
        return {}


def check_dataset(
    path: PathArg,
    policy: ShapePolicy = DEFAULT_POLICY,
    *,
    max_llm_tokens: int | None = None,
    max_encoder_tiles: int | None = None,
    decode: int | None = SAMPLED_DECODES,
    progress: bool = True,
    **media: Any,
) -> tuple[list[Problem], ReadResult | None]:
    """Like :func:`validate_dataset`, also returning the shapes of the good records.

    The second item is ``None`` when the file could not be read or its format not told.
    """
    problems: list[Problem] = []
    options = MediaOptions(**media)
    options = replace(
        options,
        image_sizes=_load_table(load_size_table, options.image_sizes, problems),
        video_frames=_load_table(load_frame_table, options.video_frames, problems),
    )
    try:
        records = load_records(path)
        fmt = detect_format(records, path)
    except DataError as error:
        return problems + [Problem.from_error(error)], None
    result = read_loaded(path, records, policy, fmt=fmt, media=options, on_bad_sample="skip", warn=False)
    problems.extend(Problem.from_error(error) for error in result.report.problems)
    kind = records[0].kind if records else "line"
    caps = (("llm_tokens", max_llm_tokens), ("encoder_tiles", max_encoder_tiles))
    for shape, number in zip(result, result.record_numbers):
        for name, cap in caps:
            value = getattr(shape, name)
            if cap is not None and value > cap:
                problems.append(
                    Problem(
                        str(path),
                        number,
                        kind,
                        shape.sample_id,
                        name,
                        f"sample has {value} {name.replace('_', ' ')}, over the cap of {cap}",
                    )
                )
    if fmt == LLAVA:
        files = spread(
            media_files(
                records, result, options, check_sizes=policy.image_rule is not None or policy.sample_images is not None
            ),
            decode,
        )
        for file, message in decode_media(files, progress=progress and decode is None):
            problems.append(Problem(str(path), file.record, kind, file.sample_id, file.field, message))
    problems.sort(key=lambda p: (p.path or "", p.record if p.record is not None else -1))
    return problems, result


def validate_dataset(
    path: PathArg,
    policy: ShapePolicy = DEFAULT_POLICY,
    *,
    max_llm_tokens: int | None = None,
    max_encoder_tiles: int | None = None,
    decode: int | None = SAMPLED_DECODES,
    **media: Any,
) -> list[Problem]:
    """Every problem of the dataset at ``path`` (empty when it is clean), in file order.

    Media are read exactly as :func:`~dflop_ds.data.read_dataset` reads them for training:
    pass the same options (image folder, tables, fallbacks) you train with.

    Args:
        path: a shape manifest or LLaVA JSON/JSONL file.
        policy: the shape policy (the caps are checked against its derived shapes).
        max_llm_tokens: report samples whose LLM sequence is longer.
        max_encoder_tiles: report samples with more encoder tiles (tiles + sampled frames).
        decode: media files of the good records to decode in full, spread over the file
            (None: every one, with a progress bar; 0: none): a truncated or corrupt file passes
            its header check and fails only here.
        **media: the fields of :class:`~dflop_ds.data.media.MediaOptions`, as for
            :func:`~dflop_ds.data.read_dataset`.
    """
    problems, _ = check_dataset(
        path, policy, max_llm_tokens=max_llm_tokens, max_encoder_tiles=max_encoder_tiles, decode=decode, **media
    )
    return problems


def format_problems(problems: Sequence[Problem]) -> str:
    """One line per problem, then a count line (``"no problems found"`` when empty)."""
    if not problems:
        return "no problems found"
    records = {(p.path, p.record) for p in problems if p.record is not None}
    lines = [str(p) for p in problems]
    where = f" in {len(records)} record(s)" if records else ""
    lines.append(f"{len(problems)} problem(s){where}")
    return "\n".join(lines)
