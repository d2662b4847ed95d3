"""DeepSpeed's 1F1B training schedule, read from DeepSpeed's own instruction stream.

``deepspeed.runtime.pipe.schedule.TrainSchedule(micro_batches, stages, stage_id).steps()`` yields,
for each of the ``2 * (n_mb + n_stages - 1)`` lock-step slots of a training step, the
instructions one stage runs in that slot: the exchange with a neighbour (``SendGrad`` and
``RecvActivation`` in a forward slot, ``RecvGrad`` and ``SendActivation`` in a backward slot),
``LoadMicroBatch`` on the first and the last stage, ``ForwardPass`` or ``BackwardPass``, and at
the end ``ReduceTiedGrads``, ``ReduceGrads``, ``OptimizerStep``.

Instructions name pipeline buffers, not microbatches; within a stage each instruction runs in
microbatch order, so the ``k``-th instruction of a class belongs to microbatch ``k``, the rule
telemetry's timers use as well. Kinds are named by :data:`KINDS`, the vocabulary
:mod:`dflop_ds.telemetry` times instructions in.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

#: DeepSpeed instruction class name -> kind (shared with dflop_ds.telemetry's timers)
KINDS = {
    "ForwardPass": "forward",
    "BackwardPass": "backward",
    "LoadMicroBatch": "load",
    "SendActivation": "send",
    "RecvActivation": "recv",
    "SendGrad": "send",
    "RecvGrad": "recv",
    "ReduceGrads": "reduce",
    "ReduceTiedGrads": "reduce",
    "OptimizerStep": "optimizer",
}
STEP_LEVEL = ("reduce", "optimizer")  # once per step, no microbatch
_SHORT = {"forward": "F", "backward": "B"}


@dataclass(frozen=True)
class Instruction:
    """One DeepSpeed instruction of one stage.

    Attributes:
        name: DeepSpeed's instruction class (``"ForwardPass"``, ``"SendGrad"``, ...).
        microbatch: the microbatch it handles; -1 for the step-level reduce and optimizer step.
    """

    name: str
    microbatch: int

    @property
    def kind(self) -> str:
        """Its kind in :data:`KINDS` (``"forward"``, ``"backward"``, ``"send"``, ...)."""
        return KINDS.get(self.name, self.name)

    @property
    def is_compute(self) -> bool:
        """A forward or a backward pass."""
        return self.kind in _SHORT

    def __str__(self) -> str:
        return f"{_SHORT.get(self.kind, self.name)}{self.microbatch if self.microbatch >= 0 else ''}"


@lru_cache(maxsize=512)
def stage_instructions(stage: int, n_stages: int, n_mb: int) -> tuple[tuple[Instruction, ...], ...]:
    """Per slot, the instructions ``stage`` runs in DeepSpeed's ``TrainSchedule`` (microbatches numbered)."""
    if n_stages < 1 or n_mb < 1 or not 0 <= stage < n_stages:
        raise ValueError(f"need n_stages >= 1, n_mb >= 1 and 0 <= stage < n_stages, got {stage}, {n_stages}, {n_mb}")
    # imported here: `import dflop_ds.plan` (and the CLI) stays free of DeepSpeed's import and its log line
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    seen: Counter[str] = Counter()
    slots = []
    for commands in TrainSchedule(micro_batches=n_mb, stages=n_stages, stage_id=stage).steps():
        row = []
        for command in commands:
            name = type(command).__name__
            step_level = KINDS.get(name) in STEP_LEVEL
            row.append(Instruction(name, -1 if step_level else seen[name]))
            seen[name] += 0 if step_level else 1
        slots.append(tuple(row))
    return tuple(slots)


def compute_of(slot: tuple[Instruction, ...]) -> Instruction | None:
    """The forward or backward pass of one slot's instructions, or None (an idle slot)."""
    return next((i for i in slot if i.is_compute), None)


def train_schedule(n_stages: int, n_mb: int) -> list[list[Instruction | None]]:
    """The compute of the whole step: ``table[slot][stage]`` is a forward/backward or None (idle)."""
    stages = [stage_instructions(s, n_stages, n_mb) for s in range(n_stages)]
    return [[compute_of(stages[s][t]) for s in range(n_stages)] for t in range(len(stages[0]))]


def stage_order(stage: int, n_stages: int, n_mb: int) -> list[Instruction]:
    """The forward and backward passes of one stage, in the order DeepSpeed runs them."""
    return [i for slot in stage_instructions(stage, n_stages, n_mb) for i in slot if i.is_compute]


def format_schedule(n_stages: int, n_mb: int) -> str:
    """A printable table: one line per stage, one column per slot (``.`` for idle)."""
    table = train_schedule(n_stages, n_mb)
    lines = []
    for s in range(n_stages):
        cells = [str(row[s]) if row[s] is not None else "." for row in table]
        lines.append(f"stage {s}: " + " ".join(f"{c:>3}" for c in cells))
    return "\n".join(lines)
