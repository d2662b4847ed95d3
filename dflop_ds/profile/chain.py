"""Time each layer of a chain inside one connected forward+backward pass of the whole chain.

Timed on its own, a layer runs its backward right after its forward, with only its own
activations alive. Inside a model every forward runs first and the backwards follow in reverse
order, with every layer's saved activations alive at once; on a CPU that changes a layer's time
by several percent, in either direction, with the microbatch's size. The chain pass below runs
the profiled layers as a model does and attributes the time to them:

- a layer's forward is the time of its call (the last layer's includes the loss);
- a layer's backward ends when the backward of the layer before starts: autograd runs the
  ready node created last first, so the first hook to fire on the floating-point tensors the
  layer before produced (tensors seen earlier in the chain, passed through unchanged, are left
  out: a leaf's gradient can be accumulated early) marks it. A layer that gets no such tensor
  (e.g. the first trainable block after a frozen embedding) ends its backward when the last of
  its parameters has its gradient; a layer with neither has no backward. The first layer's
  backward ends when the whole backward does. Every hook is removed after the pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from dflop_ds.profile.timing import Inputs, OutputLoss, accelerator, as_tuple, float_outputs

Layer = torch.nn.Module


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
    inputs_ready: dict[int, float] = {}
    params_ready: dict[int, float] = {}

    def mark_inputs(index: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if index not in inputs_ready:  # the first: the layer before has started its backward
                acc.synchronize()
                inputs_ready[index] = now()

        return hook

    def mark_params(index: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            acc.synchronize()
            params_ready[index] = now()  # the last of the layer's parameters to get its gradient

        return hook

    handles: list[Any] = []
    forward: list[float] = []
    seen = {id(t): t for t in inputs}  # the tensors themselves: a freed tensor's id can come back
    current = inputs
    try:
        with context():
            acc.synchronize()
            for index, layer in enumerate(layers):
                if index > 0:
                    fresh = [t for t in float_outputs(current) if id(t) not in seen]
                    handles += [t.register_hook(mark_inputs(index)) for t in fresh]
                    if not fresh:
                        trained = [p for p in layer.parameters() if p.requires_grad]
                        handles += [p.register_post_accumulate_grad_hook(mark_params(index)) for p in trained]
                    seen.update((id(t), t) for t in current)
                start = now()
                outputs = layer(current)
                if index == len(layers) - 1 and loss is not None:
                    outputs = loss(outputs)
                acc.synchronize()
                forward.append(now() - start)
                current = as_tuple(outputs)
            start = now()
            if loss is not None:
                current[0].backward()
            elif float_outputs(current):
                grads_of = float_outputs(current)
                torch.autograd.backward(grads_of, [torch.ones_like(t) for t in grads_of])
            acc.synchronize()
            end = now()
    finally:
        for handle in handles:
            handle.remove()
    # boundary[i]: when layer i's backward ended (layer n's "backward" ends where backward starts)
    boundary = [0.0] * (len(layers) + 1)
    boundary[len(layers)] = start
    for index in range(len(layers) - 1, 0, -1):
        ready = inputs_ready.get(index, params_ready.get(index, boundary[index + 1]))
        boundary[index] = max(ready, boundary[index + 1])
    boundary[0] = end
    return [forward[i] + boundary[i] - boundary[i + 1] for i in range(len(layers))]


__all__ = ["time_chain"]
