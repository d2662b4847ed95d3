"""Timing and memory measurement of one layer's forward+backward, on any accelerator.

Everything device-specific goes through ``deepspeed.accelerator.get_accelerator()``; on a CPU
the peak memory is the growth of the process's peak resident set (Linux ``VmHWM``, reset
through ``/proc/self/clear_refs``), since the CPU accelerator only samples the current RSS.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

Inputs = tuple[torch.Tensor, ...]
STATISTICS = ("median", "min", "trimmed_mean")
CLOCKS = ("auto", "wall", "cpu")


def accelerator():  # noqa: ANN201 - DeepSpeed's accelerator type is private
    """DeepSpeed's accelerator (imported lazily: importing deepspeed is slow)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


def profiling_device() -> torch.device:
    """The device DeepSpeed would train on (``cuda:0``, ``xpu:0``, ``cpu``, ...)."""
    acc = accelerator()
    name = acc.device_name()
    return torch.device(name if name == "cpu" else acc.device_name(acc.current_device()))


def resolve_clock(clock: str = "auto") -> str:
    """``"wall"`` or ``"cpu"``; ``"auto"`` is ``"cpu"`` on a CPU device, else ``"wall"``.

    On a CPU, the process's CPU time is the compute time of a rank running with one thread,
    without the time other processes on a shared machine take from it; on an accelerator,
    the wall time between synchronizations is the kernel time.
    """
    if clock not in CLOCKS:
        raise ValueError(f"unknown clock {clock!r}; choose one of {CLOCKS}")
    if clock == "auto":
        return "cpu" if accelerator().device_name() == "cpu" else "wall"
    return clock


def clock_function(clock: str) -> Callable[[], float]:
    """The timer of a resolved clock: ``time.perf_counter`` or ``time.process_time``."""
    return time.process_time if resolve_clock(clock) == "cpu" else time.perf_counter


def robust_statistic(values: Sequence[float], statistic: str = "median") -> float:
    """Summarize repeated timings: ``median``, ``min`` or ``trimmed_mean`` (drops 20% each side)."""
    if not values:
        raise ValueError("robust_statistic needs at least one value")
    if statistic == "median":
        return float(statistics.median(values))
    if statistic == "min":
        return float(min(values))
    if statistic == "trimmed_mean":
        ordered = sorted(values)
        cut = int(len(ordered) * 0.2)
        kept = ordered[cut : len(ordered) - cut] or ordered
        return float(sum(kept) / len(kept))
    raise ValueError(f"unknown statistic {statistic!r}; choose one of {STATISTICS}")


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak memory growth during a block: accelerator peak allocation, or peak RSS on a CPU.

    Use as ``with PeakMemory() as peak: ...`` then read ``peak.bytes`` (``None`` when the
    platform offers no way to measure it).
    """

    def __init__(self) -> None:
        self.bytes: int | None = None
        self._cpu = accelerator().device_name() == "cpu"
        self._base = 0

    def __enter__(self) -> PeakMemory:
        if self._cpu:
            try:
                with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
                    refs.write("5")  # resets VmHWM to the current RSS
                self._base = (_status_kib("VmRSS") or 0) * 1024
            except OSError:
                self._base = -1
        else:
            acc = accelerator()
            acc.synchronize()
            acc.reset_peak_memory_stats()
            self._base = int(acc.memory_allocated())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._cpu:
            peak = _status_kib("VmHWM")
            if self._base >= 0 and peak is not None:
                self.bytes = max(0, peak * 1024 - self._base)
        else:
            acc = accelerator()
            acc.synchronize()
            self.bytes = max(0, int(acc.max_memory_allocated()) - self._base)


@contextmanager
def saved_activation_bytes(exclude: Sequence[torch.Tensor] = ()) -> Iterator[list[int]]:
    """Count the bytes autograd saves for backward inside the block (parameters excluded).

    Yields a one-element list whose value is final when the block exits. Tensors sharing one
    storage are counted once.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: set[int] = set()
    total = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        try:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in skip and key not in seen and storage.nbytes() > 0:
                seen.add(key)
                total[0] += storage.nbytes()
        except (RuntimeError, NotImplementedError):  # sparse or meta tensors
            pass
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield total


def as_tuple(outputs: Any) -> tuple[Any, ...]:
    """A layer's outputs as a tuple (a single tensor becomes a 1-tuple)."""
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def float_outputs(outputs: object) -> list[torch.Tensor]:
    """The floating-point tensors of a layer's output that carry a gradient history."""
    return [t for t in as_tuple(outputs) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]


def prepare_inputs(inputs: Sequence[torch.Tensor], device: torch.device, requires_grad: bool) -> Inputs:
    """Move ``inputs`` to ``device`` as fresh leaves; floating ones require grad if asked."""
    prepared = []
    for tensor in inputs:
        leaf = tensor.detach().to(device)
        if requires_grad and leaf.is_floating_point():
            leaf.requires_grad_(True)
        prepared.append(leaf)
    return tuple(prepared)


OutputLoss = Callable[[object], torch.Tensor]


def forward_backward(layer: torch.nn.Module, inputs: Inputs, loss: OutputLoss | None = None) -> None:
    """One forward and backward pass of ``layer`` on ``inputs``.

    With ``loss``, backward starts from ``loss(outputs)`` (a scalar, as on a pipeline's last
    stage); otherwise from a gradient of ones on every floating-point output.
    """
    outputs = layer(inputs)
    if loss is not None:
        loss(outputs).backward()
        return
    grads_of = float_outputs(outputs)
    if grads_of:
        torch.autograd.backward(grads_of, [torch.ones_like(t) for t in grads_of])


def time_once(
    layer: torch.nn.Module,
    inputs: Inputs,
    now: Callable[[], float],
    context: Callable[[], AbstractContextManager[object]] = nullcontext,
    loss: OutputLoss | None = None,
) -> float:
    """Seconds (by the timer ``now``) of one synchronized forward+backward inside ``context``."""
    acc = accelerator()
    acc.synchronize()
    start = now()
    with context():
        forward_backward(layer, inputs, loss)
    acc.synchronize()
    return now() - start


def time_forward_backward(
    layer: torch.nn.Module,
    inputs: Inputs,
    *,
    warmup: int = 2,
    repeats: int = 5,
    statistic: str = "median",
    contexts: Sequence[Callable[[], AbstractContextManager[object]]] = (nullcontext,),
    clock: str = "auto",
) -> list[float]:
    """Robust seconds of one forward+backward of ``layer`` on ``inputs``, per context.

    Each entry of ``contexts`` is entered around its passes (e.g. to swap attention for an
    identity); the variants are interleaved within every repeat so that a change of machine
    load affects them alike. ``clock`` is as in :func:`resolve_clock`.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    now = clock_function(clock)
    samples: list[list[float]] = [[] for _ in contexts]
    for i in range(warmup + repeats):
        for slot, context in enumerate(contexts):
            elapsed = time_once(layer, inputs, now, context)
            if i >= warmup:
                samples[slot].append(elapsed)
    return [robust_statistic(values, statistic) for values in samples]
