"""How far to trust the simulator: its last measured error against real runs.

``make validate-simulator`` (benchmarks/validate_simulator.py) replays real 2-rank runs with the
simulator and writes its mean relative step-time errors to ``out/simulator_calibration.json``
(:func:`save_calibration`). Where no such file is at hand, the last figures recorded in
docs/benchmarks.md are used, marked as such (:data:`DOCUMENTED`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflop_ds.jsonio import read_json_object

#: where ``make validate-simulator`` writes its result, relative to the repository root
CALIBRATION_FILE = Path("out") / "simulator_calibration.json"
FIGURES = ("error", "cost_model_only", "colocated_error", "colocated_cost_model_only")
#: what is known on GPUs while no GPU validation run is recorded (docs/benchmarks.md, "GPU")
GPU_NOTE = (
    "the simulator has not been checked against a GPU run; on one H100 (make gpu-check, 26 Nov 2026,"
    " docs/benchmarks.md) the cost model's microbatch time error was 6-15%"
)


@dataclass(frozen=True)
class Calibration:
    """The simulator's mean relative step-time errors on real runs and where they come from.

    Attributes:
        error: pipelined run (2 stages), simulated with the engine profile.
        cost_model_only: the same run from the cost model alone.
        colocated_error, colocated_cost_model_only: the colocated ZeRO-2 run, likewise.
        measured: when the runs were made.
        machine: what ran them.
        source: the file or document the figures were read from.
    """

    error: float
    cost_model_only: float
    colocated_error: float
    colocated_cost_model_only: float
    measured: str
    machine: str
    source: str

    def describe(self) -> str:
        """One line for a printout."""
        gpu = "" if "GPU" in self.machine else f"; {GPU_NOTE}"
        return (
            f"simulator vs real runs ({self.machine}, {self.measured}; from {self.source}): mean step-time error "
            f"{self.error:.1%} pipelined, {self.colocated_error:.1%} colocated (cost model alone: "
            f"{self.cost_model_only:.1%}, {self.colocated_cost_model_only:.1%}){gpu}"
        )


DOCUMENTED = Calibration(
    error=0.237,
    cost_model_only=0.167,
    colocated_error=0.157,
    colocated_cost_model_only=0.167,
    measured="23 Nov 2026 18:30",
    machine="2 CPU ranks, tiny model",
    source="docs/benchmarks.md",
)


def save_calibration(path: str | Path, figures: dict[str, float], measured: str, machine: str) -> None:
    """Write a validation run's ``figures`` (the keys of :data:`FIGURES`) to ``path``."""
    record: dict[str, Any] = {name: float(figures[name]) for name in FIGURES}
    record.update(measured=measured, machine=machine)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2) + "\n")


def load_calibration(path: str | Path | None = None) -> Calibration:
    """The calibration in ``path`` (default :data:`CALIBRATION_FILE` when it exists), else :data:`DOCUMENTED`.

    Raises:
        ValueError: the file is not a calibration record (naming the file and the missing key).
    """
    file = Path(path) if path is not None else CALIBRATION_FILE
    if path is None and not file.exists():
        return DOCUMENTED
    data = read_json_object(file)
    missing = [key for key in (*FIGURES, "measured", "machine") if key not in data]
    if missing:
        raise ValueError(f"{file}: not a simulator calibration record (missing {', '.join(missing)})")
    return Calibration(
        **{name: float(data[name]) for name in FIGURES},
        measured=str(data["measured"]),
        machine=str(data["machine"]),
        source=str(file),
    )
