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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dflop_ds.pipe.stage_bounds import StageBounds, uniform_bounds

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


def separate_stages(encoder_layers: int, llm_layers: int, e_pp: int, l_pp: int) -> tuple[StageLayers, ...]:
    """Encoder stages then LLM stages, each segment split uniformly (DeepSpeed's rule); the
    projector joins the first LLM stage."""
    enc = [(k, 0, 0) for k in uniform_bounds(encoder_layers, e_pp).sizes()]
    llm = [(0, 1 if i == 0 else 0, k) for i, k in enumerate(uniform_bounds(llm_layers, l_pp).sizes())]
    return tuple(enc + llm)
