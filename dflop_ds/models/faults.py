"""Fault injection (``dflop.testing.fault``): make one shape class of the tiny model slower than the
cost model believes, at run time, for tests and demos of the adaptive correction."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflop_ds.deepspeed_keys import DeepSpeedKeys
from dflop_ds.typecheck import check_setting


@dataclass(frozen=True)
class FaultSpec:
    """The ``"fault"`` entry of the ``"dflop"`` block: samples with more than ``min_tiles``
    encoder tiles cost ``seconds_per_tile`` extra per tile in the first encoder layer's forward,
    from step ``start_step`` on (counted in forward calls of microbatches: ``start_step * GAS``).

    ``base_seconds_per_tile`` adds that much per tile of *every* sample from the start: an encoder
    whose time the tile count predicts well, so that on a small shared CPU the encoder stage's
    time is dominated by a known cost rather than by other processes' noise (tests, demos).
    """

    min_tiles: int
    seconds_per_tile: float
    start_step: int = 0
    base_seconds_per_tile: float = 0.0

    @classmethod
    def from_dict(cls, block: dict[str, Any] | None, source: str = "fault") -> FaultSpec | None:
        """Build and validate (None stays None); bad keys and values are named."""
        if block is None:
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(block) - known)
        missing = sorted({"min_tiles", "seconds_per_tile"} - set(block))
        if unknown or missing:
            raise ValueError(f"{source}: unknown key(s) {unknown} / missing key(s) {missing}; known: {sorted(known)}")
        spec = cls(**block)
        check_setting(f"{source}.min_tiles", spec.min_tiles, "int", minimum=0)
        check_setting(f"{source}.seconds_per_tile", spec.seconds_per_tile, "number", minimum=0)
        check_setting(f"{source}.base_seconds_per_tile", spec.base_seconds_per_tile, "number", minimum=0)
        check_setting(f"{source}.start_step", spec.start_step, "int", minimum=0)
        return spec

    def delay(self, tiles_per_sample: torch.Tensor, faulty: bool = True) -> float:
        """Seconds of extra work for a microbatch with these per-sample tile counts (``faulty``:
        whether the slow class is slow yet)."""
        tiles = tiles_per_sample.detach().to("cpu")
        seconds = float(tiles.sum().item()) * self.base_seconds_per_tile
        if faulty:
            seconds += float(tiles[tiles > self.min_tiles].sum().item()) * self.seconds_per_tile
        return seconds


class SlowTiles(nn.Module):
    """Wraps a first encoder layer ``(vis, input_ids, text_lens, tiles_per_sample) -> ...`` and
    sleeps in its forward for the samples the :class:`FaultSpec` makes slow.

    Args:
        layer: the wrapped layer (its parameters stay trainable), or a DeepSpeed ``LayerSpec`` of
            it (built here, so ``LayerSpec(SlowTiles, spec_of_layer, fault)`` works in a
            ``PipelineModule``).
        spec: which samples and how slow.
        start_call: forward calls to run at normal speed first (a fault that appears mid-run).
    """

    def __init__(self, layer: nn.Module, spec: FaultSpec, start_call: int = 0) -> None:
        super().__init__()
        if not isinstance(layer, nn.Module) and hasattr(layer, "build"):
            layer = layer.build()
        self.layer = layer
        self.spec = spec
        self.start_call = int(start_call)
        self.calls = 0
        self.slept_s = 0.0

    def forward(self, inputs):
        """The wrapped layer's forward, after the injected delay."""
        self.calls += 1
        delay = self.spec.delay(inputs[3], faulty=self.calls > self.start_call)
        if delay > 0:
            time.sleep(delay)
            self.slept_s += delay
        return self.layer(inputs)


def inject_fault(encoder_layers: list, spec: FaultSpec | None, keys: DeepSpeedKeys) -> list:
    """``encoder_layers`` with the first one wrapped in :class:`SlowTiles`
    when ``dflop.testing.fault`` asks for it (layers may be modules or DeepSpeed ``LayerSpec``);
    ``keys`` (the DeepSpeed config's) give the microbatches per step its ``start_step`` counts in."""
    if spec is None:
        return encoder_layers
    start_call = 0
    if spec.start_step:
        gas = keys.gradient_accumulation_steps
        if not isinstance(gas, int):
            raise ValueError(
                'dflop.testing.fault.start_step needs "gradient_accumulation_steps" in the DeepSpeed config'
            )
        start_call = spec.start_step * gas
    first = encoder_layers[0]
    if hasattr(first, "build"):
        from deepspeed.pipe import LayerSpec

        wrapped = LayerSpec(SlowTiles, first, spec, start_call)
    else:
        wrapped = SlowTiles(first, spec, start_call)
    return [wrapped] + list(encoder_layers[1:])
