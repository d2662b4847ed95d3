"""The inputs of one launch, resolved once on global rank 0 and shared with every rank.

Every rank computes the schedule itself from the data set's shape table, the cost model and the
plan, so all three must be the same everywhere, or ranks train mismatched microbatches (on two
nodes with their own profile caches, each node would profile its own cost model).
:func:`agree_on_inputs` makes global rank 0 the one source of truth:

- rank 0 reads the shape table (image and video headers) and resolves the cost model (a file,
  the profile cache or a fresh profile: profiling runs on rank 0 only), and broadcasts both as
  objects (``broadcast_object_list``); every other rank trains on the copies it receives;
- every rank checks what it reads itself (the data file its dataset loads, the media files its
  records name, the plan, a cost model named in the config) against rank 0's digests; what it
  received from rank 0 is not checked again (it is rank 0's by construction);
- any disagreement stops every rank before the first step, naming the input, both digests and
  the source on each side.

A set-up step that may fail on one rank only before those collectives (loading the model from a
node's folder) runs under :func:`all_ranks_or_none`, so that every rank stops naming the rank that
failed and why, instead of the others waiting in the next collective until its timeout.

Digests are pure functions (:func:`json_digest`, :func:`file_digest`, :func:`cost_model_digest`,
:func:`input_digests`, :func:`disagreements`, :func:`media_differences`, :func:`step_failures`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from dflop_ds.config import DFLOPConfig
from dflop_ds.cost import CostModel, cost_model_to_dict, load_cost_model
from dflop_ds.data import ReadResult
from dflop_ds.data.media import media_folder, record_image_paths
from dflop_ds.data.records import load_records
from dflop_ds.models.tiny_profile import cached_tiny_cost_model
from dflop_ds.schedule.state import dataset_fingerprint
from dflop_ds.shapes import SampleShape

#: timed rounds of the automatic profile (the `profile model` default is 5; 3 keeps it short)
AUTO_PROFILE_REPEATS = 3
#: ``dflop.sampler.cost_model`` value that asks for the sampler's unitless proxy instead of a profiled model
PROXY = "proxy"
#: names of the inputs, as messages print them
SHAPE_TABLE, COST_MODEL, PLAN, DATA_FILE, MEDIA = "shape table", "cost model", "plan", "data file", "media files"
#: a media file's size in a listing (:func:`media_listing`) when this process cannot see it
MISSING = -1
#: media files a disagreement names at most, per rank
NAMED_MEDIA = 5

T = TypeVar("T")


class InputMismatchError(RuntimeError):
    """The ranks of one launch disagree on an input of the schedule."""


class SetupStepError(RuntimeError):
    """A set-up step failed on some rank of the launch (raised on every rank)."""


def step_failures(step_name: str, errors_per_rank: Sequence[str | None]) -> str | None:
    """One message naming every rank whose ``step_name`` failed and its error (``errors_per_rank[r]``,
    None where rank ``r`` succeeded), or None when no rank failed."""
    failed = [(rank, error) for rank, error in enumerate(errors_per_rank) if error is not None]
    if not failed:
        return None
    ranks = ", ".join(str(rank) for rank, _ in failed)
    return f"{step_name} failed on rank(s) {ranks} of {len(errors_per_rank)}:\n  " + "\n  ".join(
        f"rank {rank}: {error}" for rank, error in failed
    )


def all_ranks_or_none(step_name: str, step: Callable[[], T]) -> T:
    """``step()`` run on every rank: its result when it succeeded everywhere; otherwise every rank
    raises :class:`SetupStepError` naming the rank(s) that failed and their errors (the failing
    rank's error chained). A collective (one ``all_gather_object``) when a process group of more
    than one rank is up; without one, ``step()`` itself."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return step()
    failure: Exception | None = None
    result: Any = None
    try:
        result = step()
    except Exception as error:  # every rank learns of it, not only this one
        failure = error
    errors: list[Any] = [None] * dist.get_world_size()
    _set_object_device()
    dist.all_gather_object(errors, None if failure is None else f"{type(failure).__name__}: {failure}")
    report = step_failures(step_name, errors)
    if report is not None:
        raise SetupStepError(report) from failure
    return result


@dataclass(frozen=True)
class InputDigest:
    """What one rank holds of one input: its ``name``, a short ``digest`` of its content and the
    ``source`` it came from on that rank (a path, the profile cache, ``"received from rank 0"``)."""

    name: str
    digest: str
    source: str


def json_digest(value: Any) -> str:
    """A short hash of a JSON-ready value (keys sorted, so equal content gives equal digests)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def file_digest(path: str | Path, chunk: int = 1 << 20) -> str:
    """A short hash of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()[:16]


def cost_model_digest(model: CostModel | None) -> str:
    """A short hash of ``model``'s file content (:func:`~dflop_ds.cost.cost_model_to_dict`; None,
    the unitless proxy, digests as JSON ``null``): a rank that reads the same file, or receives
    the model from rank 0, digests alike."""
    return json_digest(None if model is None else cost_model_to_dict(model))


def media_listing(data_path: str, image_folder: str | None = None, video_folder: str | None = None) -> dict[str, int]:
    """Every image and video file the records of ``data_path`` name, as ``"image:PATH"`` or
    ``"video:PATH"`` (the path as the record gives it) -> its size in bytes as this process sees
    it under its folder (:func:`~dflop_ds.data.media.media_folder`: by default the data file's),
    :data:`MISSING` where it cannot. Only file metadata is read, no pixel."""
    folders = {"image": media_folder(data_path, image_folder), "video": media_folder(data_path, video_folder)}
    listing = {}
    for raw in load_records(data_path):
        video = raw.value.get("video") if isinstance(raw.value, Mapping) else None
        named = [("image", path) for path in record_image_paths(raw.value)]
        named += [("video", video)] if isinstance(video, str) and video else []
        for kind, path in named:
            try:
                size = os.stat(os.path.join(folders[kind], path)).st_size
            except OSError:
                size = MISSING
            listing[f"{kind}:{path}"] = size
    return listing


def media_differences(reference: Mapping[str, int], mine: Mapping[str, int], rank: int) -> list[str]:
    """The media files rank ``rank`` sees otherwise than rank 0 (``reference``), missing or with
    another size, the first :data:`NAMED_MEDIA` by name (and how many more)."""

    def seen(size: int | None) -> str:
        return "missing" if size is None or size == MISSING else f"{size} bytes"

    differing = [key for key in sorted(set(reference) | set(mine)) if reference.get(key) != mine.get(key)]
    problems = [
        f"rank {rank}: {key.replace(':', ' ', 1)} is {seen(mine.get(key))} there, {seen(reference.get(key))} on rank 0"
        for key in differing[:NAMED_MEDIA]
    ]
    if len(differing) > NAMED_MEDIA:
        problems.append(f"rank {rank}: ... and {len(differing) - NAMED_MEDIA} more media file(s) differ")
    return problems


def input_digests(
    *,
    shapes: Sequence[SampleShape] | None,
    cost_model: CostModel | None,
    cost_source: str | None,
    plan_state: dict[str, Any] | None,
    plan_source: str | None,
    data_path: str | None,
    shapes_source: str,
    media: Mapping[str, int] | None = None,
    media_source: str = "",
) -> list[InputDigest]:
    """The digests of the inputs one rank holds: a ``None`` source means the rank does not hold
    that input itself (a rank other than 0 takes the cost model and shape table from rank 0);
    ``shapes`` None likewise. The data file is hashed as bytes, since every rank loads its
    records (``"missing"`` where this rank cannot see it); ``media`` (:func:`media_listing`,
    None: not held) as JSON, since every rank loads its files; no plan or no cost model (the
    proxy) digests as JSON ``null``."""
    digests = []
    if shapes is not None:
        digests.append(InputDigest(SHAPE_TABLE, dataset_fingerprint(shapes), shapes_source))
    if cost_source is not None:
        digests.append(InputDigest(COST_MODEL, cost_model_digest(cost_model), cost_source))
    if plan_source is not None:
        digests.append(InputDigest(PLAN, json_digest(plan_state), plan_source))
    if data_path is not None and not Path(data_path).exists():
        digests.append(InputDigest(DATA_FILE, "missing", data_path))
    elif data_path is not None and Path(data_path).is_file():
        digests.append(InputDigest(DATA_FILE, file_digest(data_path), data_path))
    if media is not None:
        digests.append(InputDigest(MEDIA, json_digest(media), media_source))
    return digests


def disagreements(reference: Sequence[InputDigest], mine: Sequence[InputDigest], rank: int) -> list[str]:
    """One message per input that rank ``rank`` holds with another digest than rank 0's
    (``reference``): the input, both digests and both sources. Inputs only one side holds are
    not compared."""
    theirs = {entry.name: entry for entry in reference}
    problems = []
    for entry in mine:
        other = theirs.get(entry.name)
        if other is not None and other.digest != entry.digest:
            problems.append(
                f"rank {rank}: its {entry.name} differs from rank 0's: digest {entry.digest} from {entry.source},"
                f" rank 0 has {other.digest} from {other.source}"
            )
    return problems


def mismatch_report(problems_per_rank: Sequence[Sequence[str]]) -> str | None:
    """One message for every rank's problems, or None when every rank agrees."""
    problems = [problem for rank_problems in problems_per_rank for problem in rank_problems]
    if not problems:
        return None
    return (
        "the ranks of this launch disagree on the inputs of the schedule:\n  "
        + "\n  ".join(problems)
        + "\nevery node must see the same files (put data, images, cost model and plan on a shared filesystem,"
        " see docs/multinode.md)"
    )


def resolve_cost_model(cfg: DFLOPConfig, log: Callable[[str], None] = print) -> tuple[CostModel | None, str]:
    """The run's cost model and where it came from: the config's file (or reference name);
    ``"proxy"``: None (the unitless proxy); unset: the tiny model's profiled cost model from the
    profile cache (profiled once per model, machine and software, see
    :mod:`dflop_ds.profile.cache`). HuggingFace models without one use the proxy."""
    if cfg.sampler.cost_model == PROXY:
        return None, "the unitless proxy (dflop.sampler.cost_model = proxy)"
    if cfg.sampler.cost_model is not None:
        return load_cost_model(cfg.sampler.cost_model), cfg.sampler.cost_model
    if cfg.model.name_or_path is not None:
        log(
            "[dflop-ds] no cost model given: balancing on the unitless proxy (profile the model with "
            "`dflop-ds profile model --model_name_or_path ...` and pass --cost-model)"
        )
        return None, "the unitless proxy (no cost model given)"
    cost_model, path = cached_tiny_cost_model(cfg.model.tiny, log=log, repeats=AUTO_PROFILE_REPEATS)
    return cost_model, f"the profile cache {path}"


@dataclass
class LaunchInputs:
    """The inputs every rank trains with, agreed across the launch."""

    shapes: ReadResult
    cost_model: CostModel | None
    digests: list[InputDigest]


def agree_on_inputs(
    cfg: DFLOPConfig,
    read_shapes: Callable[[], ReadResult],
    plan: Any = None,
    log: Callable[[str], None] = print,
    check_shapes: Callable[[ReadResult], None] | None = None,
) -> LaunchInputs:
    """The launch's shape table and cost model, resolved on global rank 0 (``read_shapes()``,
    :func:`resolve_cost_model`) and broadcast; every rank's own data file, plan (``plan``, as
    loaded from ``cfg.plan``) and named cost model checked against rank 0's. Raises
    :class:`InputMismatchError` on every rank when any rank disagrees. ``check_shapes(shapes)``
    runs on rank 0 between reading the shapes and resolving the cost model (the tiny model's is
    profiled on first use): its error stops every rank before that work. A collective: every rank
    calls it after ``deepspeed.init_distributed``."""
    import torch.distributed as dist

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0
    plan_state = None if plan is None else plan.to_dict()
    plan_source = cfg.plan.file or "no plan"
    payload: list[Any] = [None]
    failure: Exception | None = None
    if rank == 0:
        try:
            payload = [_resolve_on_rank_zero(cfg, read_shapes, plan_state, plan_source, log, check_shapes)]
        except Exception as error:  # every rank stops with rank 0's reason, not a collective timeout
            failure = error
            payload = [{"error": f"{type(error).__name__}: {error}"}]
    if distributed:
        _set_object_device()
        dist.broadcast_object_list(payload, src=0)
    if failure is not None:
        raise failure
    if "error" in payload[0]:
        raise RuntimeError(f"rank 0 stopped the launch while reading its inputs: {payload[0]['error']}")
    shared = payload[0]
    problems = [] if rank == 0 else check_against_rank_zero(cfg, shared, plan_state, plan_source, rank)
    if distributed:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, problems)
        report = mismatch_report(everyone)
        if report is not None:
            raise InputMismatchError(report)
    reference = list(shared["reference"])
    if rank == 0:
        log("[dflop-ds] inputs agreed on every rank: " + ", ".join(f"{d.name} {d.digest}" for d in reference))
    return LaunchInputs(shared["shapes"], shared["cost_model"], reference)


def check_against_rank_zero(
    cfg: DFLOPConfig, shared: dict[str, Any], plan_state: dict[str, Any] | None, plan_source: str, rank: int
) -> list[str]:
    """This rank's disagreements with rank 0 on what it reads itself: its data file, the media
    files the records name (each differing file named), plan and named cost model (the shape
    table, and a cost model not named, it takes from rank 0); an input it cannot read is a
    disagreement too."""
    named = (
        cfg.sampler.cost_model if cfg.sampler.cost_model != PROXY else None
    )  # a named cost model: this rank reads its own copy
    try:
        media = _own_media(cfg)
        mine = input_digests(
            shapes=None,
            cost_model=load_cost_model(named) if named else None,
            cost_source=named,
            plan_state=plan_state,
            plan_source=plan_source,
            data_path=cfg.data.path,
            shapes_source="",
            media=media,
            media_source=_media_source(cfg),
        )
    except (OSError, ValueError) as error:
        return [f"rank {rank}: cannot read its own inputs: {error}"]
    problems = disagreements(shared["reference"], mine, rank)
    if media is not None and shared.get("media") is not None and media != shared["media"]:
        problems += media_differences(shared["media"], media, rank)
    return problems


def _own_media(cfg: DFLOPConfig) -> dict[str, int] | None:
    """This process's :func:`media_listing` of the run's data file (None without a readable one)."""
    if cfg.data.path is None or not Path(cfg.data.path).is_file():
        return None
    return media_listing(cfg.data.path, cfg.data.image_folder, cfg.data.video_folder)


def _media_source(cfg: DFLOPConfig) -> str:
    data = cfg.data.path or ""
    return (
        f"the images under {media_folder(data, cfg.data.image_folder)} and videos under"
        f" {media_folder(data, cfg.data.video_folder)} that {data} names"
    )


def _resolve_on_rank_zero(
    cfg: DFLOPConfig,
    read_shapes: Callable[[], ReadResult],
    plan_state: dict[str, Any] | None,
    plan_source: str,
    log: Callable[[str], None],
    check_shapes: Callable[[ReadResult], None] | None,
) -> dict[str, Any]:
    """What rank 0 broadcasts: the shape table (checked by ``check_shapes``), the cost model (the
    object: pickled by the broadcast, no file format on the way) and its source, the media listing
    (so that another rank's differing files can be named) and the digests of every input it holds."""
    shapes = read_shapes()
    if check_shapes is not None:
        check_shapes(shapes)
    cost_model, cost_source = resolve_cost_model(cfg, log)
    media = _own_media(cfg)
    reference = input_digests(
        shapes=shapes,
        cost_model=cost_model,
        cost_source=cost_source,
        plan_state=plan_state,
        plan_source=plan_source,
        data_path=cfg.data.path,
        shapes_source=f"the records and media headers of {cfg.data.path}, read on rank 0",
        media=media,
        media_source=_media_source(cfg),
    )
    return {
        "shapes": shapes,
        "cost_model": cost_model,
        "cost_source": cost_source,
        "media": media,
        "reference": reference,
    }


def _set_object_device() -> None:
    """Select this process's accelerator before the first object collective, as DeepSpeed's
    engine does later (NCCL sends objects through the current device)."""
    from deepspeed.accelerator import get_accelerator

    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None:
        get_accelerator().set_device(int(local_rank))


__all__ = [
    "AUTO_PROFILE_REPEATS",
    "PROXY",
    "InputDigest",
    "InputMismatchError",
    "LaunchInputs",
    "SetupStepError",
    "agree_on_inputs",
    "all_ranks_or_none",
    "check_against_rank_zero",
    "cost_model_digest",
    "disagreements",
    "file_digest",
    "input_digests",
    "json_digest",
    "media_differences",
    "media_listing",
    "mismatch_report",
    "resolve_cost_model",
    "step_failures",
]
