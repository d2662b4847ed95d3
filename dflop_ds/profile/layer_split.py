"""Per-layer costs measured on a model's own microbatches, for choosing pipeline stage bounds.

A 2-stage split of a small model moves whole layers, so a bias in the relative cost of the
encoder and the LLM picks the wrong boundary. Measured here (tiny MLLM, packed microbatches of
the bundled mixture, one thread): the profiled cost model predicted the LLM layers 1.6x
cheaper relative to the encoder's than they ran, and its split ``[0, 5, 11]`` gave the LLM
stage 1.45-1.5x the encoder stage's time (``[0, 6, 11]``: 1.2-1.3x; a decoder layer is ~13% of
the compute). Under the model-order timing protocol (``TIMING_PROTOCOL`` 2 of
:mod:`dflop_ds.profile.model`, layers timed on their own), six fresh profiles at load ~2
all split ``[0, 6, 11]``, a near tie with ``[0, 7, 11]`` for the measured best; the five read
rated the LLM 1.16-1.28x the encoder against 1.30x measured (``benchmarks/bench_stage_split.py``
compares every split's simulated step on measured layer costs).
This module times every layer's forward and backward on real collated microbatches (the layout
the engine trains, loss included on the last layer) so that
:func:`~dflop_ds.pipe.stage_bounds.split_by_cost` balances what the stages will run. Ranks that
measure on their own may disagree on a near tie: measure once and hand every rank the bounds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from dflop_ds.profile.timing import accelerator, clock_function

Microbatch = tuple[Any, Any]


def _leaf(value: Any) -> Any:
    """``value`` cut from its graph: floating-point tensors become leaves that collect a gradient."""
    if isinstance(value, tuple):
        return tuple(_leaf(v) for v in value)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_(True)
    return value


def _float_pairs(output: Any, grad: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The floating-point tensors of ``output`` that have a gradient in ``grad``, with it."""
    outputs = output if isinstance(output, tuple) else (output,)
    grads = grad if isinstance(grad, tuple) else (grad,)
    pairs = [(o, g) for o, g in zip(outputs, grads) if isinstance(o, torch.Tensor) and g is not None]
    return [o for o, _ in pairs], [g for _, g in pairs]


def _input_grads(inputs: Any) -> Any:
    """The gradients the leaves of :func:`_leaf` collected, in the same structure (None elsewhere)."""
    if isinstance(inputs, tuple):
        return tuple(_input_grads(v) for v in inputs)
    return inputs.grad if isinstance(inputs, torch.Tensor) and inputs.is_floating_point() else None


def _time_microbatch(
    layers: Sequence[torch.nn.Module],
    microbatch: Microbatch,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    clock: Callable[[], float],
    out: np.ndarray,
) -> None:
    """Add every layer's forward and backward seconds on ``microbatch`` to ``out[0]`` and
    ``out[1]`` (the loss is charged to the last layer, as the pipeline's last stage computes it)."""
    sync = accelerator().synchronize
    x, labels = microbatch
    leaves, outputs = [], []
    for i, layer in enumerate(layers):
        leaf = _leaf(x) if i else x  # the first layer's inputs are data, without gradients
        sync()
        start = clock()
        x = layer(leaf)
        if i == len(layers) - 1:
            x = loss_fn(x, labels)
        sync()
        out[0, i] += clock() - start
        leaves.append(leaf)
        outputs.append(x)
    grad: Any = None
    for i in range(len(layers) - 1, -1, -1):
        if grad is None:  # the loss
            tensors, grads = [outputs[i]], [torch.ones_like(outputs[i])]
        else:
            tensors, grads = _float_pairs(outputs[i], grad)
        sync()
        start = clock()
        if tensors:
            torch.autograd.backward(tensors, grads)
        sync()
        out[1, i] += clock() - start
        grad = _input_grads(leaves[i])


def measure_layer_times(
    layers: Sequence[torch.nn.Module],
    microbatches: Sequence[Microbatch],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    repeats: int = 1,
    warmup: int = 2,
    clock: str = "auto",
) -> np.ndarray:
    """``(2, len(microbatches), len(layers))`` forward (``[0]``) and backward (``[1]``) seconds of
    every layer of a flat pipeline layer list on every microbatch (``(inputs, labels)`` as the
    engine receives them), the median over ``repeats`` passes, after ``warmup`` untimed microbatches.

    ``loss_fn(last_layer_output, labels)`` is charged to the last layer. ``clock`` as in
    :func:`~dflop_ds.profile.timing.resolve_clock` (``"auto"``: CPU time of this process on a
    CPU device, so other processes' load does not count; wall time on accelerators).
    Parameters' gradients accumulate; zero them afterwards if the layers are trained.
    """
    if not layers or not microbatches:
        raise ValueError(
            f"measure_layer_times needs layers and microbatches, got {len(layers)} and {len(microbatches)}"
        )
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    tick = clock_function(clock)
    scratch = np.zeros((2, len(layers)))
    for k in range(warmup):
        _time_microbatch(layers, microbatches[k % len(microbatches)], loss_fn, tick, scratch)
    passes = np.zeros((repeats, 2, len(microbatches), len(layers)))
    for r in range(repeats):
        for j, microbatch in enumerate(microbatches):
            _time_microbatch(layers, microbatch, loss_fn, tick, passes[r, :, j])
    return np.median(passes, axis=0)


def measure_layer_costs(
    layers: Sequence[torch.nn.Module],
    microbatches: Sequence[Microbatch],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    **options: Any,
) -> np.ndarray:
    """``(len(layers),)`` forward + backward seconds of every layer summed over ``microbatches``
    (:func:`measure_layer_times`, same ``options``): the layer costs a stage split balances."""
    return measure_layer_times(layers, microbatches, loss_fn, **options).sum(axis=(0, 1))
