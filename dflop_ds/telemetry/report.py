"""Turn a run's telemetry log (``dflop_telemetry.jsonl``) into plots and a short text summary."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np

LOG_NAME = "dflop_telemetry.jsonl"


def find_log(run: str | Path) -> Path:
    """The telemetry log of ``run``: the file itself, or the newest ``dflop_telemetry.jsonl`` under
    a folder (e.g. the csv_monitor output folder)."""
    path = Path(run)
    if path.is_file():
        return path
    if path.is_dir():
        found = sorted(path.rglob(LOG_NAME), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1]
        raise FileNotFoundError(f"{path}: no {LOG_NAME} in this folder or below (was the run started with telemetry?)")
    raise FileNotFoundError(f"{path}: no such file or folder")


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """The per-step records of a telemetry log. A bad line is named by its number, except an
    unfinished last line (a run killed while writing it), which is left out with a warning."""
    lines = Path(path).read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number == len(lines):
                warnings.warn(f"{path}:{number}: left out an unfinished last record (a killed run?)", stacklevel=2)
                continue
            raise ValueError(f"{path}:{number}: not a JSON record ({error})") from error
    if not records:
        raise ValueError(f"{path}: no telemetry records")
    return records


def split_runs(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Records of several runs appended to one log, one list per run in log order: by
    ``run_id``, or, for records without one, where the step number stops increasing."""
    runs: list[list[dict[str, Any]]] = []
    for record in records:
        previous = runs[-1][-1] if runs else None
        if (
            previous is None
            or record.get("run_id") != previous.get("run_id")
            or (record.get("run_id") is None and record.get("step", 0) <= previous.get("step", 0))
        ):
            runs.append([])
        runs[-1].append(record)
    return runs


def select_run(runs: list[list[dict[str, Any]]], run_id: str | None, index: int, source: str) -> list[dict]:
    """The run named ``run_id`` (when given), else the ``index``-th (negative: from the end)."""
    if run_id is not None:
        chosen = [record for run in runs for record in run if record.get("run_id") == run_id]
        if not chosen:
            known = [run[0].get("run_id") for run in runs]
            raise ValueError(f"{source}: no run with id {run_id!r}; its runs: {known}")
        return chosen
    if not -len(runs) <= index < len(runs):
        raise ValueError(f"{source}: holds {len(runs)} run(s), no run index {index}")
    return runs[index]


def _series(records: list[dict], key: str) -> np.ndarray:
    values = [r.get(key) for r in records]
    return np.array([v if isinstance(v, (int, float)) and v is not None else np.nan for v in values], dtype=float)


def summarize(records: list[dict]) -> dict[str, Any]:
    """Median figures of a run (NaN-free keys only)."""
    out: dict[str, Any] = {"steps": len(records)}
    for key in (
        "step_s",
        "imbalance_observed",
        "imbalance_predicted",
        "bubble_fraction",
        "schedule_ms",
        "telemetry_overhead_frac",
    ):
        values = _series(records, key)
        if np.isfinite(values).any():
            out[f"median_{key}"] = float(np.nanmedian(values))
    active = [bool(r.get("correction_active")) for r in records if "correction_active" in r]
    if active:
        out["correction_active_steps"] = int(sum(active))
    solvers = sorted({r["solver"] for r in records if r.get("solver")})
    if solvers:
        out["solvers"] = solvers
    return out


def scatter_points(records: list[dict], observed: str = "mb_observed") -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per stage: (predicted, observed) per microbatch over the steps.

    ``observed`` names the records' observed times: ``mb_observed`` (wall seconds of forward +
    backward) or ``mb_observed_cpu`` (their CPU seconds, where the run measured them).

    Steps scheduled on corrected per-stage seconds (``predicted_space == "stage"``) compare stage
    ``s`` with predicted column ``s``; when there are such steps only they are used (the other
    steps' costs are in the cost model's units). Otherwise each stage is compared with the
    largest-total predicted column.
    """
    points: dict[int, tuple[list, list]] = {}
    in_seconds = any(r.get("predicted_space") == "stage" for r in records)
    for r in records:
        predicted, times = r.get("mb_predicted"), r.get(observed)
        if not predicted or not times or (r.get("predicted_space") == "stage") != in_seconds:
            continue
        pred = np.asarray(predicted, dtype=float)
        obs = np.asarray(times, dtype=float)
        if pred.shape[0] != obs.shape[1]:
            continue
        for s in range(obs.shape[0]):
            column = s if in_seconds and pred.shape[1] == obs.shape[0] else int(pred.sum(0).argmax())
            ok = obs[s] >= 0
            xs, ys = points.setdefault(s, ([], []))
            xs.extend(pred[ok, column].tolist())
            ys.extend(obs[s, ok].tolist())
    return {s: (np.array(x), np.array(y)) for s, (x, y) in points.items()}


def plot_run(records: list[dict], out_dir: str | Path, title: str | None = None) -> list[Path]:
    """Write ``imbalance.png`` (over steps) and ``predicted_vs_observed.png``; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = _series(records, "step")
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("imbalance_observed", "observed (busiest stage)"), ("imbalance_predicted", "predicted")):
        values = _series(records, key)
        if np.isfinite(values).any():
            ax.plot(steps, values, marker="o", ms=3, label=label)
    active = _series(records, "correction_active")
    if np.nansum(active) > 0:
        ax.fill_between(
            steps,
            0,
            1,
            where=active > 0,
            transform=ax.get_xaxis_transform(),
            alpha=0.12,
            color="green",
            label="correction applied",
        )
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean microbatch cost")
    ax.set_title(title or "microbatch imbalance")
    ax.legend()
    fig.tight_layout()
    written.append(out_dir / "imbalance.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    points = scatter_points(records)
    if points:
        fig, axes = plt.subplots(1, len(points), figsize=(4.2 * len(points), 4), squeeze=False)
        for ax, (stage, (x, y)) in zip(axes[0], sorted(points.items())):
            ax.scatter(x, y, s=8, alpha=0.6)
            if x.size > 1 and np.ptp(x) > 0:
                r = np.corrcoef(x, y)[0, 1]
                ax.set_title(f"stage {stage} (r = {r:.2f})")
            else:
                ax.set_title(f"stage {stage}")
            ax.set_xlabel("predicted microbatch cost")
            ax.set_ylabel("observed compute (s)")
        fig.tight_layout()
        written.append(out_dir / "predicted_vs_observed.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as aligned ``key: value`` lines."""
    lines = []
    for key, value in summary.items():
        if isinstance(value, float):
            value = f"{value:.4g}" if math.isfinite(value) else "-"
        lines.append(f"{key:32s} {value}")
    return "\n".join(lines)
