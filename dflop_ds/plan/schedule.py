"""DeepSpeed's 1F1B training schedule, as plain data.

DeepSpeed (``deepspeed.runtime.pipe.schedule.TrainSchedule``) runs a training step as
``2 * (n_mb + n_stages - 1)`` lock-step slots. In every slot each stage either runs a forward
of one microbatch, a backward of one, or idles: even stages run forwards in even slots and
backwards in odd ones, odd stages the other way round. The microbatch of a slot is a closed
formula of (slot, stage), so the whole schedule is a small table we can print, test and simulate.

A forward of microbatch ``j`` on stage ``s`` always sits exactly one slot after the forward of
``j`` on stage ``s - 1``, and a backward one slot after the backward on stage ``s + 1``: visiting
slots in order therefore visits every operation after the operations it depends on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["F", "B"]


@dataclass(frozen=True)
class Op:
    """One compute operation: ``kind`` ``"F"`` (forward) or ``"B"`` (backward) of ``microbatch``."""

    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def slot_op(slot: int, stage: int, n_stages: int, n_mb: int) -> Op | None:
    """The operation stage ``stage`` runs in slot ``slot`` of DeepSpeed's TrainSchedule, or None.

    Forward slots are those whose parity equals the stage's; the forward microbatch is
    ``slot // 2 - stage // 2``. Backward slots have the other parity; the backward microbatch
    is ``slot // 2 - n_stages + (stage + 1) // 2`` (slot even) or
    ``(slot - 1) // 2 - n_stages + 1 + stage // 2`` (slot odd). Out-of-range ids are idle slots.
    """
    if not 0 <= stage < n_stages:
        raise ValueError(f"stage {stage} outside [0, {n_stages})")
    half = slot // 2
    if slot % 2 == stage % 2:
        kind: Kind = "F"
        mb = half - stage // 2
    elif slot % 2 == 0:
        kind = "B"
        mb = half - n_stages + (stage + 1) // 2
    else:
        kind = "B"
        mb = half - n_stages + 1 + stage // 2
    return Op(kind, mb) if 0 <= mb < n_mb else None


def n_slots(n_stages: int, n_mb: int) -> int:
    """Slots in one training step: ``2 * (n_mb + n_stages - 1)``."""
    return 2 * (n_mb + n_stages - 1)


def train_schedule(n_stages: int, n_mb: int) -> list[list[Op | None]]:
    """The full schedule: ``table[slot][stage]`` is an :class:`Op` or None (idle slot)."""
    if n_stages < 1 or n_mb < 1:
        raise ValueError(f"need n_stages >= 1 and n_mb >= 1, got {n_stages}, {n_mb}")
    return [[slot_op(t, s, n_stages, n_mb) for s in range(n_stages)] for t in range(n_slots(n_stages, n_mb))]


def stage_order(stage: int, n_stages: int, n_mb: int) -> list[Op]:
    """The compute operations of one stage, in the order DeepSpeed runs them."""
    ops = (slot_op(t, stage, n_stages, n_mb) for t in range(n_slots(n_stages, n_mb)))
    return [op for op in ops if op is not None]


def format_schedule(n_stages: int, n_mb: int) -> str:
    """A printable table: one line per stage, one column per slot (``.`` for idle)."""
    table = train_schedule(n_stages, n_mb)
    lines = []
    for s in range(n_stages):
        cells = [str(row[s]) if row[s] is not None else "." for row in table]
        lines.append(f"stage {s}: " + " ".join(f"{c:>3}" for c in cells))
    return "\n".join(lines)
