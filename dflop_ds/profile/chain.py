"""Time each layer of a chain inside one connected forward+backward pass of the whole chain.

Timed on its own, a layer runs its backward right after its forward, with only its own
activations alive. Inside a model every forward runs first and the backwards follow in reverse
order, with every layer's saved activations alive at once; on a CPU that changes a layer's time
by several percent, in either direction, with the microbatch's size. The chain pass below runs
the profiled layers as a model does and attributes the time to them:

- a layer's forward is the time of its call (the last layer's includes the loss);
- a layer's backward ends when autograd has the gradient of its own inputs (a hook on the
  floating-point tensors the previous layer produced: the earliest of them, since a tensor that
  is also passed on to later layers gets its gradient only after theirs), and starts where the
  next layer's backward ended. A layer whose inputs carry no gradient is lumped into the layer
  before it; the first layer's backward ends when the whole backward does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from dflop_ds.profile.timing import Inputs, OutputLoss, accelerator, float_outputs

Layer = torch.nn.Module


def _as_tuple(outputs: Any) -> Inputs:
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def time_chain(
    layers: Sequence[Layer],
    inputs: Inputs,
    now: Callable[[], float],
    *,
    loss: OutputLoss | None = None,
    context: Callable[[], AbstractContextManager[object]] = nullcontext,
) -> list[float]:
    """Seconds of forward+backward of each of ``layers``, run in order on ``inputs`` (the first
    layer's) as one connected pass inside ``context``; backward starts from ``loss`` of the last
    layer's outputs, or from a gradient of ones on them."""
    if not layers:
        raise ValueError("cannot time an empty chain of layers")
    acc = accelerator()
    gradient_ready: dict[int, float] = {}

    def mark(index: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if index not in gradient_ready:  # the first of the layer's inputs to get its gradient
                acc.synchronize()
                gradient_ready[index] = now()

        return hook

    forward: list[float] = []
    seen = {id(t) for t in inputs}
    current = inputs
    with context():
        acc.synchronize()
        for index, layer in enumerate(layers):
            if index > 0:
                for tensor in float_outputs(current):
                    if id(tensor) not in seen:  # produced by the layer before, not passed through
                        tensor.register_hook(mark(index))
                seen.update(id(t) for t in current)
            start = now()
            outputs = layer(current)
            if index == len(layers) - 1 and loss is not None:
                outputs = loss(outputs)
            acc.synchronize()
            forward.append(now() - start)
            current = _as_tuple(outputs)
        start = now()
        if loss is not None:
            current[0].backward()
        elif float_outputs(current):
            grads_of = float_outputs(current)
            torch.autograd.backward(grads_of, [torch.ones_like(t) for t in grads_of])
        acc.synchronize()
        end = now()
    # boundary[i]: when layer i's backward ended (layer n's "backward" ends where backward starts)
    boundary = [0.0] * (len(layers) + 1)
    boundary[len(layers)] = start
    for index in range(len(layers) - 1, 0, -1):
        boundary[index] = max(gradient_ready.get(index, boundary[index + 1]), boundary[index + 1])
    boundary[0] = end
    return [forward[i] + boundary[i] - boundary[i + 1] for i in range(len(layers))]


__all__ = ["time_chain"]
