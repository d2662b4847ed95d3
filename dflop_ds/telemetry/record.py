"""Per-step telemetry figures as plain data: imbalance, bubble, monitor events, the log line."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dflop_ds.shapes import SampleShape

#: record key -> monitor event name (numbers only: TensorBoard scalars and CSV columns)
MONITOR_FIELDS = {
    "step_s": "dflop/step_s",
    "imbalance_observed": "dflop/imbalance_observed",
    "imbalance_predicted": "dflop/imbalance_predicted",
    "imbalance_predicted_encoder": "dflop/imbalance_predicted_encoder",
    "imbalance_predicted_llm": "dflop/imbalance_predicted_llm",
    "bubble_fraction": "dflop/bubble_fraction",
    "wait_fraction": "dflop/wait_fraction",
    "schedule_ms": "dflop/schedule_ms",
    "solver_exact": "dflop/solver_exact",
    "correction_active": "dflop/correction_active",
    "correction_gain_s": "dflop/correction_gain_s",
    "correction_overhead_s": "dflop/correction_overhead_s",
    "correction_penalty": "dflop/correction_max_penalty",
    "telemetry_overhead_frac": "dflop/telemetry_overhead_frac",
}


def imbalance(values: np.ndarray) -> float:
    """max / mean of non-negative values (1.0 is perfect balance; NaN when nothing is known)."""
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    if values.size == 0 or values.mean() <= 0:
        return float("nan")
    return float(values.max() / values.mean())


def observed_imbalance(stage_times: np.ndarray) -> tuple[list[float], float]:
    """Per stage max/mean microbatch compute time, and that of the busiest stage (the pace setter).

    ``stage_times`` is ``(S, M)``: seconds of each of the step's ``M`` microbatches (all
    data-parallel ranks) on each stage, NaN where unobserved.
    """
    times = np.asarray(stage_times, dtype=float)
    per_stage = [imbalance(row) for row in times]
    totals = np.nansum(times, axis=1)
    busiest = int(totals.argmax()) if totals.size else 0
    return per_stage, per_stage[busiest] if per_stage else float("nan")


def bubble_fraction(compute_s: np.ndarray, step_s: float) -> float:
    """Share of the step that ranks spend not computing: ``1 - mean(compute) / step``."""
    compute_s = np.asarray(compute_s, dtype=float)
    if step_s <= 0 or compute_s.size == 0:
        return float("nan")
    return float(1.0 - compute_s.mean() / step_s)


def monitor_events(record: dict[str, Any], step: int) -> list[tuple[str, float, int]]:
    """The record's numeric fields as DeepSpeed monitor events ``(name, value, step)``."""
    events = []
    for key, name in MONITOR_FIELDS.items():
        value = record.get(key)
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            events.append((name, float(value), int(step)))
    return events


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def log_line(record: dict[str, Any]) -> str:
    """One concise line: step, time, imbalance predicted/observed, bubble, scheduler, correction."""
    correction = "off"
    if record.get("correction_tracking") or record.get("correction_active"):
        state = "on" if record.get("correction_active") else "tracking"
        correction = (
            f"{state} gain {_fmt(record.get('correction_gain_s'), '.4f')}s "
            f"cost {_fmt(record.get('correction_overhead_s'), '.4f')}s "
            f"max-penalty {_fmt(record.get('correction_penalty'), '.2f')}"
        )
    return (
        f"[dflop-ds] telemetry step {record.get('step', 0):3d} {_fmt(record.get('step_s'))}s "
        f"imbalance pred {_fmt(record.get('imbalance_predicted'))} obs {_fmt(record.get('imbalance_observed'))} "
        f"bubble {_fmt(record.get('bubble_fraction'), '.2f')} "
        f"sched {_fmt(record.get('schedule_ms'), '.1f')}ms/{record.get('solver', '-')} "
        f"correction {correction} "
        f"telemetry {_fmt(100 * record.get('telemetry_overhead_frac', float('nan')), '.2f')}%"
    )


def batch_tokens(
    microbatches: Sequence[Sequence[int]], shapes: Sequence[SampleShape], packed: bool = False
) -> dict[str, int]:
    """Samples, real LLM tokens and tokens after padding each microbatch to its longest sample
    (packed microbatches have no padding: their padded tokens are their tokens)."""
    lengths = [[shapes[i].llm_tokens for i in mb] for mb in microbatches if len(mb)]
    tokens = int(sum(sum(mb) for mb in lengths))
    return {
        "samples": sum(len(mb) for mb in lengths),
        "tokens": tokens,
        "padded_tokens": tokens if packed else int(sum(len(mb) * max(mb) for mb in lengths)),
    }


def throughput(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Samples/s, tokens/s, median step and padding efficiency of step rows that carry
    ``step_s`` and the fields of :func:`batch_tokens`."""
    seconds = sum(r["step_s"] for r in rows)
    return {
        "samples_per_s": sum(r["samples"] for r in rows) / seconds,
        "tokens_per_s": sum(r["tokens"] for r in rows) / seconds,
        "median_step_s": float(np.median([r["step_s"] for r in rows])),
        "padding_efficiency": sum(r["tokens"] for r in rows) / sum(r["padded_tokens"] for r in rows),
    }
