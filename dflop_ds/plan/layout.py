"""Layouts: how the GPUs and the layers of encoder + projector + LLM are arranged.

A layout is a pipeline of stages, each holding a contiguous range of the flat layer list
``encoder layers + projector + LLM layers`` (the order of ``MLLMPipelineModule``). Stages that
hold encoder layers run with the encoder's (tp, dp), the others with the LLM's. When both
segments share tp and dp, the layout is one DeepSpeed pipeline of ``n_stages * tp * dp`` GPUs
(a stage may then hold the last encoder layers and the first LLM layers together); otherwise
the encoder and the LLM run on separate GPU sets, DFLOP's general case, which stock DeepSpeed
cannot run (its topology gives every stage the same dp). A *colocated* layout runs the encoder
data-parallel over every GPU outside the pipeline (``encoder = Segment(1, 1, GPUs)``) and the
LLM pipeline on the same GPUs; its stages list the encoder layers on stage 0 (where the flat
layer list puts them) but no stage runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dflop_ds.pipe.stage_bounds import StageBounds, check_stage_count

StageLayers = tuple[int, int, int]  # (encoder layers, projector layers, LLM layers) of one stage


@dataclass(frozen=True)
class Segment:
    """Parallel degrees of one model segment (encoder or LLM)."""

    tp: int
    pp: int
    dp: int

    @property
    def gpus(self) -> int:
        """GPUs of the segment: ``tp * pp * dp``."""
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class Layout:
    """One candidate arrangement, scored by the simulator.

    Attributes:
        encoder, llm: degrees; for a shared pipeline both have the same tp and dp and ``pp``
            counts the stages holding layers of that segment.
        n_mb: microbatches per data-parallel rank and step (DeepSpeed's gradient accumulation).
        stages: ``(encoder, projector, llm)`` layer counts per stage, in pipeline order.
        splitter: the registered splitter (:mod:`dflop_ds.schedule.splitters`) cutting each
            global batch into microbatches: ``"dflop"`` (our data-aware ones), ``"stock"``
            (fixed sample counts), ``"llava"``, ``"verl"``, ...
        colocated: the encoder runs data-parallel over all GPUs, outside the LLM pipeline
            (``dflop.model.encoder = "colocated"``).
    """

    encoder: Segment
    llm: Segment
    n_mb: int
    stages: tuple[StageLayers, ...]
    splitter: str = "dflop"
    colocated: bool = False

    @property
    def n_stages(self) -> int:
        """Stages of the whole pipeline."""
        return len(self.stages)

    @property
    def shared(self) -> bool:
        """True when encoder and LLM share tp and dp: one DeepSpeed pipeline."""
        return self.encoder.tp == self.llm.tp and self.encoder.dp == self.llm.dp

    @property
    def deepspeed_compatible(self) -> bool:
        """Runs on stock DeepSpeed as is (one topology: same dp and tp for every stage; a
        colocated encoder is a replica on every rank of that topology)."""
        return self.shared or self.colocated

    @property
    def gpus(self) -> int:
        """GPUs used."""
        if self.colocated:
            return self.llm.gpus
        if self.shared:
            return self.n_stages * self.llm.tp * self.llm.dp
        return self.encoder.gpus + self.llm.gpus

    def stage_segment(self, s: int) -> Segment:
        """The degrees stage ``s`` runs with (the encoder's when it holds encoder layers)."""
        return self.encoder if self.stages[s][0] > 0 and not self.colocated else self.llm

    def describe(self) -> str:
        """A one-line summary such as ``E(tp1,pp1,dp8) L(tp1,pp2,dp8) mb4``."""
        e, lm = self.encoder, self.llm
        kind = "colocated" if self.colocated else "shared" if self.shared else "separate"
        return f"E(tp{e.tp},pp{e.pp},dp{e.dp}) L(tp{lm.tp},pp{lm.pp},dp{lm.dp}) mb{self.n_mb} {kind}"


def stage_layers(values: Sequence[Any]) -> StageLayers:
    """One stage's ``(encoder, projector, LLM)`` layer counts read from a list (a plan file's);
    ``ValueError`` unless it holds three integers."""
    if len(values) != 3:
        raise ValueError(f"a stage holds (encoder, projector, llm) layer counts, got {list(values)}")
    encoder, projector, llm = (int(x) for x in values)
    return encoder, projector, llm


def flat_bounds(stages: Sequence[StageLayers]) -> StageBounds:
    """Stage boundaries over the flat layer list: ``bounds[s]:bounds[s+1]`` is stage ``s``."""
    return StageBounds.from_sizes(sum(stage) for stage in stages)


def stages_from_bounds(
    bounds: Sequence[int], encoder_layers: int, projector_layers: int, llm_layers: int
) -> tuple[StageLayers, ...]:
    """Inverse of :func:`flat_bounds` for given segment depths."""
    split = StageBounds(bounds, n_layers=encoder_layers + projector_layers + llm_layers)
    cuts = (encoder_layers, encoder_layers + projector_layers)
    out = []
    for lo, hi in split.ranges():
        e = max(0, min(hi, cuts[0]) - lo)
        p = max(0, min(hi, cuts[1]) - max(lo, cuts[0]))
        lm = max(0, hi - max(lo, cuts[1]))
        out.append((e, p, lm))
    return tuple(out)


def uniform_bounds(n_layers: int, n_parts: int) -> StageBounds:
    """DeepSpeed's ``partition_method="uniform"``: equal counts, the remainder to the first parts."""
    check_stage_count(n_layers, n_parts)
    size, extra = divmod(n_layers, n_parts)
    return StageBounds.from_sizes(size + (1 if i < extra else 0) for i in range(n_parts))


def segment_counts(n_layers: int, n_parts: int) -> list[int]:
    """Equal layer counts for identical layers; the remainder goes to the last parts (fewer in flight)."""
    check_stage_count(n_layers, n_parts)
    size, extra = divmod(n_layers, n_parts)
    return [size + (1 if i >= n_parts - extra else 0) for i in range(n_parts)]


def separate_stages(encoder_layers: int, llm_layers: int, e_pp: int, l_pp: int) -> tuple[StageLayers, ...]:
    """Encoder stages then LLM stages; the projector joins the first LLM stage."""
    enc = [(k, 0, 0) for k in segment_counts(encoder_layers, e_pp)]
    llm = [(0, 1 if i == 0 else 0, k) for i, k in enumerate(segment_counts(llm_layers, l_pp))]
    return tuple(enc + llm)


def balanced_bounds(
    weights: Sequence[float],
    n_parts: int,
    stage_memory: Callable[[int, int, int], float] | None = None,
    memory_cap: float = float("inf"),
) -> StageBounds | None:
    """Contiguous split of ``weights`` into ``n_parts`` non-empty stages minimising the heaviest.

    ``stage_memory(stage, lo, hi)`` (optional) gives the memory of layers ``lo:hi`` on ``stage``
    (it must grow with ``hi``); no stage may exceed ``memory_cap``. Binary search on the
    bottleneck with a greedy fill; returns None when no split fits the memory cap.
    """
    n = len(weights)
    check_stage_count(n, n_parts)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))

    def fill(limit: float) -> list[int] | None:
        bounds = [0]
        for stage in range(n_parts):
            lo = bounds[-1]
            left_after = n_parts - stage - 1
            hi = lo + 1
            if prefix[hi] - prefix[lo] > limit or (stage_memory and stage_memory(stage, lo, hi) > memory_cap):
                return None
            while (
                hi < n - left_after
                and prefix[hi + 1] - prefix[lo] <= limit
                and (stage_memory is None or stage_memory(stage, lo, hi + 1) <= memory_cap)
            ):
                hi += 1
            if stage == n_parts - 1 and hi < n:
                return None
            bounds.append(hi)
        return bounds

    lo_t, hi_t = max(weights, default=0.0), prefix[-1]
    best = fill(hi_t) if stage_memory is None else None
    if best is None:
        best = fill(float("inf"))
        if best is None:
            return None
    for _ in range(40):
        if hi_t - lo_t <= 1e-9 * max(hi_t, 1e-30):
            break
        mid = 0.5 * (lo_t + hi_t)
        found = fill(mid)
        if found is None:
            lo_t = mid
        else:
            best, hi_t = found, mid
    return StageBounds(best)
