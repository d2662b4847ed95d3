"""What the Trainer's ranks must agree on before the first step, and the cost model's fit.

Every Trainer rank cuts and balances the global batches itself, from its own ``sample_shapes``,
its own copy of the cost model and the data order's seed: any difference and the ranks train
different splits (samples twice or never). :func:`check_ranks_agree` gathers each rank's digests
of those inputs (:func:`~dflop_ds.train.launch_inputs.input_digests`) and stops every rank, naming
the input, the digests and their sources, when one differs from rank 0's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dflop_ds.cost import CostModel
from dflop_ds.models.hf.registry import family_for
from dflop_ds.shapes import SampleShape
from dflop_ds.train.launch_inputs import (
    InputDigest,
    InputMismatchError,
    disagreements,
    input_digests,
    json_digest,
    media_listing,
    mismatch_report,
)

#: names of the sampler's own inputs, as messages print them
SEED, SAMPLER_SETTINGS = "data-order seed", "sampler settings"


def trainer_input_digests(
    shapes: Sequence[SampleShape],
    cost_model: CostModel | None,
    cost_source: str,
    seed: int,
    seed_source: str,
    sampler_settings: Mapping[str, Any],
    rank: int,
) -> list[InputDigest]:
    """This rank's digests of what its schedule is computed from: the shape table, the cost model
    (None: the proxy), the data order's seed and the sampler's settings (batch sizes, kind, ...);
    where the shapes were read from a data file (:func:`~dflop_ds.hf_trainer.llava_json_shapes`),
    also that file's bytes and its media files' listing, as the DeepSpeed loop digests them."""
    data_path = getattr(shapes, "data_path", None)
    media = None
    if data_path is not None and Path(data_path).is_file():
        media = media_listing(data_path, getattr(shapes, "image_folder", None), getattr(shapes, "video_folder", None))
    return [
        *input_digests(
            shapes=shapes,
            cost_model=cost_model,
            cost_source=cost_source,
            plan_state=None,
            plan_source=None,
            data_path=data_path,
            shapes_source=f"sample_shapes= on rank {rank}",
            media=media,
            media_source=f"the media of {data_path} on rank {rank}",
        ),
        InputDigest(SEED, json_digest(seed), seed_source),
        InputDigest(SAMPLER_SETTINGS, json_digest(dict(sampler_settings)), "dflop block and TrainingArguments"),
    ]


def ranks_disagreement(gathered: Sequence[Sequence[InputDigest]]) -> str | None:
    """One message naming every input on which a rank (``gathered[r]``: rank ``r``'s digests)
    differs from rank 0, or None when all agree."""
    return mismatch_report([disagreements(gathered[0], mine, rank) for rank, mine in enumerate(gathered) if rank])


def check_ranks_agree(digests: Sequence[InputDigest]) -> None:
    """Gather every rank's ``digests`` (one ``all_gather_object`` when torch.distributed runs more
    than one rank) and raise :class:`~dflop_ds.train.launch_inputs.InputMismatchError` on every
    rank when any differs from rank 0's. A collective: every rank calls it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(digests))
    report = ranks_disagreement(gathered)
    if report is not None:
        raise InputMismatchError(report)


def model_depths(model: Any) -> tuple[int, int] | None:
    """``(encoder_layers, llm_layers)`` of a model of a registered family as dflop-ds cuts it (what
    a cost model profiled on it records); None for another model (or a PEFT wrapper of none)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kind = getattr(getattr(base, "config", None), "model_type", None)
    try:
        encoder, _, llm = family_for(kind).training().layers(base)
    except (AttributeError, ValueError):  # no registered family, or one dflop-ds cannot cut: no profile exists
        return None
    return len(encoder), len(llm)


__all__ = [
    "SAMPLER_SETTINGS",
    "SEED",
    "check_ranks_agree",
    "model_depths",
    "ranks_disagreement",
    "trainer_input_digests",
]
