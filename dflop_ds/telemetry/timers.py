"""Per-microbatch, per-instruction timing inside DeepSpeed's pipeline engine, without touching
DeepSpeed's source.

The pipeline engine runs a step as a list of instructions dispatched through the class table
``PipelineEngine._INSTRUCTION_MAP``. :class:`PipelineTimer` installs an instance-level copy of
that table whose entries time the original methods, so only the one engine is affected and
:meth:`PipelineTimer.uninstall` restores it. Within a step the ``k``-th instruction of a kind
(forward, backward, send/recv of activations or gradients, load) belongs to the ``k``-th
microbatch: 1F1B runs each kind in microbatch order.

Forward and backward passes can also be timed by a CPU-time clock (:func:`compute_cpu_clock`):
on a CPU, the compute of a rank with one torch thread is the CPU time of the thread running it,
which other processes on a shared machine do not inflate the way they inflate wall time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dflop_ds.plan.instructions import KINDS  # instruction class name -> timing kind, shared with the simulator

PER_MICROBATCH = ("forward", "backward", "load", "send", "recv")
#: kinds also timed by the CPU-time clock, when the timer has one
CPU_TIMED = ("forward", "backward")
#: every kind, in the order step totals are reported
STEP_KINDS = tuple(dict.fromkeys(KINDS.values()))


def compute_cpu_clock(torch_threads: int) -> Callable[[], float]:
    """The CPU-time clock that covers a CPU rank's compute with ``torch_threads`` intra-op threads:
    the calling thread's CPU time with one thread (the sampler's background thread and the
    communication threads are left out), the whole process's with more (the pool threads compute)."""
    return time.thread_time if torch_threads <= 1 else time.process_time


@dataclass
class StageTiming:
    """One step's timings on this rank.

    Attributes:
        per_mb: kind -> ``(n_mb,)`` seconds per microbatch (forward, backward, load, send, recv;
            send/recv sum activations and gradients).
        totals: kind -> seconds over the step (all kinds, including reduce and optimizer).
        overhead_s: seconds the timing bookkeeping itself took.
        cpu_per_mb: forward and backward -> ``(n_mb,)`` CPU seconds per microbatch, when timed.
    """

    per_mb: dict[str, np.ndarray]
    totals: dict[str, float]
    overhead_s: float
    cpu_per_mb: dict[str, np.ndarray] | None = None

    @property
    def compute(self) -> np.ndarray:
        """Forward + backward seconds per microbatch."""
        return self.per_mb["forward"] + self.per_mb["backward"]

    @property
    def compute_cpu(self) -> np.ndarray | None:
        """Forward + backward CPU seconds per microbatch (``None`` without a CPU-time clock)."""
        if self.cpu_per_mb is None:
            return None
        return self.cpu_per_mb["forward"] + self.cpu_per_mb["backward"]

    @property
    def wait(self) -> np.ndarray:
        """Send + receive seconds per microbatch (blocking p2p: mostly waiting for a neighbour)."""
        return self.per_mb["send"] + self.per_mb["recv"]


@dataclass
class _Step:
    n_mb: int
    per_mb: dict[str, np.ndarray] = field(init=False)
    cpu_per_mb: dict[str, np.ndarray] = field(init=False)
    totals: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        self.per_mb = {kind: np.zeros(self.n_mb) for kind in PER_MICROBATCH}
        self.cpu_per_mb = {kind: np.zeros(self.n_mb) for kind in CPU_TIMED}


class PipelineTimer:
    """Times every pipeline instruction of one ``PipelineEngine``.

    Args:
        engine: a DeepSpeed ``PipelineEngine`` (anything with an ``_INSTRUCTION_MAP`` of
            instruction class -> method).
        micro_batches: microbatches per step (``engine.gradient_accumulation_steps()``).
        synchronize: called after each timed instruction (e.g. the accelerator's
            ``synchronize`` on GPUs, so asynchronous kernels are charged to their instruction);
            None on CPU.
        cpu_clock: also time forward and backward passes by this clock (a CPU-time clock,
            :func:`compute_cpu_clock`; only meaningful on a CPU device); None: wall time only.
    """

    def __init__(
        self,
        engine,
        micro_batches: int,
        synchronize: Callable[[], None] | None = None,
        cpu_clock: Callable[[], float] | None = None,
    ) -> None:
        self.engine = engine
        self.micro_batches = int(micro_batches)
        self.synchronize = synchronize
        self.cpu_clock = cpu_clock
        self._step = _Step(self.micro_batches)
        self._installed = False

    def install(self) -> PipelineTimer:
        """Shadow the engine's instruction table with timed entries (this engine only)."""
        if self._installed:
            return self
        table = type(self.engine)._INSTRUCTION_MAP
        self.engine._INSTRUCTION_MAP = {
            cls: self._timed(method, KINDS.get(cls.__name__, cls.__name__)) for cls, method in table.items()
        }
        self._installed = True
        return self

    def uninstall(self) -> None:
        """Restore the engine's own instruction table."""
        if self._installed:
            del self.engine._INSTRUCTION_MAP
            self._installed = False

    def _timed(self, method: Callable, kind: str) -> Callable:
        timed = self._timed_wall(method, kind)
        if self.cpu_clock is not None and kind in CPU_TIMED:
            return self._timed_cpu(timed, kind, self.cpu_clock)
        return timed

    def _timed_wall(self, method: Callable, kind: str) -> Callable:
        clock, sync = time.perf_counter, self.synchronize

        def timed(engine, **kwargs):
            t0 = clock()
            step = self._step
            t1 = clock()
            try:
                return method(engine, **kwargs)
            finally:
                if sync is not None:
                    sync()
                t2 = clock()
                elapsed = t2 - t1
                step.totals[kind] = step.totals.get(kind, 0.0) + elapsed
                per_mb = step.per_mb.get(kind)
                if per_mb is not None:
                    k = step.counts.get(kind, 0)
                    step.counts[kind] = k + 1
                    if kind in ("send", "recv"):
                        # activations go forward in microbatch order, gradients backward in the same
                        # order: the k-th of each direction is microbatch k (count both per direction)
                        k = self._direction_index(step, kind, method)
                    if k < per_mb.size:
                        per_mb[k] += elapsed
                step.overhead_s += (t1 - t0) + (clock() - t2)

        return timed

    def _timed_cpu(self, timed: Callable, kind: str, cpu_clock: Callable[[], float]) -> Callable:
        """``timed`` (a wall-timed forward or backward) also charged, by ``cpu_clock``, to the
        microbatch the wall timing charged it to."""

        def timed_cpu(engine, **kwargs):
            step = self._step
            start = cpu_clock()
            try:
                return timed(engine, **kwargs)
            finally:
                k = step.counts.get(kind, 0) - 1  # the wall timing counted this pass already
                if 0 <= k < self.micro_batches:
                    step.cpu_per_mb[kind][k] += cpu_clock() - start

        return timed_cpu

    @staticmethod
    def _direction_index(step: _Step, kind: str, method: Callable) -> int:
        key = f"{kind}:{getattr(method, '__name__', '')}"
        k = step.counts.get(key, 0)
        step.counts[key] = k + 1
        return k

    def start_step(self) -> None:
        """Start collecting a new step."""
        self._step = _Step(self.micro_batches)

    def finish_step(self) -> StageTiming:
        """The timings collected since :meth:`start_step`."""
        step = self._step
        cpu = {k: v.copy() for k, v in step.cpu_per_mb.items()} if self.cpu_clock is not None else None
        return StageTiming({k: v.copy() for k, v in step.per_mb.items()}, dict(step.totals), step.overhead_s, cpu)
