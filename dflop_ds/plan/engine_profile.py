"""Engine profile: what a training step costs beyond the layers' own compute.

The model profiler times each layer alone. Inside DeepSpeed's pipeline engine a step pays more,
and a simulator fed the layer times alone runs fast (26% on the bundled 2-rank CPU run). A
short profiling run of the engine (any sampler, any split; telemetry on) measures the rest:

- ``compute_scale``: how much slower the encoder and the LLM compute inside the engine than
  alone (ranks sharing a machine's caches and memory bandwidth, the framework's per-call work).
  A non-negative least-squares fit of every measured microbatch-stage time on the cost model's
  encoder and LLM parts of it.
- ``forward_fraction``: the measured forward share of forward+backward.
- ``load_s``: ``LoadMicroBatch`` seconds per microbatch on the first and the last stage.
- ``tail_s``: the step's gradient reduction and optimizer step, per stage.
- ``exchange_s``: seconds one blocking send/receive costs both neighbours. Not observable
  directly (a blocked receive mostly waits), so it is the value for which the simulator,
  given the run's *measured* compute, load and tail, reproduces the run's mean step time.

:meth:`EngineProfile.simulate` then predicts a step of another run (other batches, sampler or
stage split) from cost-model predictions. Load and tail are kept per stage position (first,
middle, last); profile again when the stage count changes. The profile belongs to one
machine and launch: it is measured, never analytic.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflop_ds.cost import CostModel, LayeredCostModel
from dflop_ds.jsonio import read_json_object, write_json
from dflop_ds.plan.simulator import SimResult, simulate_1f1b
from dflop_ds.plan.stages import stage_shares
from dflop_ds.shapes import SampleShape

FORMAT = "dflop-ds-engine-profile"
FORMAT_VERSION = 1
TAIL_KINDS = ("reduce", "optimizer")


@dataclass
class EngineStep:
    """One measured step of the profiling run, for one data-parallel rank.

    Attributes:
        costs: ``(m, 2)`` cost-model ``[encoder, llm]`` seconds of each microbatch.
        compute: ``(m, p)`` measured forward+backward seconds per microbatch and stage.
        totals: instruction kind (``forward``, ``backward``, ``load``, ``reduce``, ``optimizer``,
            ...) -> ``(p,)`` seconds over the step.
        step_s: the measured step time.
    """

    costs: np.ndarray
    compute: np.ndarray
    totals: dict[str, np.ndarray]
    step_s: float


@dataclass
class EngineProfile:
    """Measured engine terms the simulator adds to a cost model (see the module docstring)."""

    compute_scale: list[float]
    forward_fraction: float
    load_s: list[float]
    tail_s: list[float]
    exchange_s: float
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_stages(self) -> int:
        """Pipeline stages of the profiling run."""
        return len(self.tail_s)

    def per_stage(self, values: Sequence[float], n_stages: int) -> np.ndarray:
        """Per-position values of the profiling run for ``n_stages`` stages: first to first,
        last to last, the middle stages' mean to every middle stage."""
        array = np.asarray(values, dtype=float)
        if n_stages == len(array):
            return array.copy()
        middle = float(array[1:-1].mean()) if len(array) > 2 else 0.0
        out = np.full(n_stages, middle)
        out[0], out[-1] = array[0], array[-1]
        return out

    def stage_seconds(self, costs: np.ndarray, shares: np.ndarray) -> np.ndarray:
        """``(..., m, p)`` in-engine forward+backward seconds from ``(..., m, 2)`` cost-model
        predictions and ``(p, 2)`` stage shares of the encoder and the LLM."""
        scaled = np.asarray(costs, dtype=float) * np.asarray(self.compute_scale, dtype=float)
        return scaled @ np.asarray(shares, dtype=float).T

    def simulate(self, costs: np.ndarray, shares: np.ndarray) -> SimResult:
        """Simulate one step of ``(m, 2)`` (or ``(R, m, 2)``) predicted microbatch costs split
        over stages by ``shares``, with this profile's engine terms."""
        stage = self.stage_seconds(costs, shares)
        n_stages = stage.shape[-1]
        load = self.per_stage(self.load_s, n_stages)
        if n_stages > 2:
            load[1:-1] = 0.0  # only the first and the last stage load microbatches
        fwd = self.forward_fraction * stage + load
        bwd = (1.0 - self.forward_fraction) * stage
        return simulate_1f1b(fwd, bwd, act_comm=self.exchange_s, allreduce=self.per_stage(self.tail_s, n_stages))

    # -- files ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return {"format": FORMAT, "version": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "engine profile") -> EngineProfile:
        """Inverse of :meth:`to_dict`; errors name ``source`` and the key at fault."""
        if data.get("format") != FORMAT:
            raise ValueError(f"{source}: not an engine profile (format {data.get('format')!r}, expected {FORMAT!r})")
        try:
            profile = cls(
                compute_scale=[float(x) for x in data["compute_scale"]],
                forward_fraction=float(data["forward_fraction"]),
                load_s=[float(x) for x in data["load_s"]],
                tail_s=[float(x) for x in data["tail_s"]],
                exchange_s=float(data["exchange_s"]),
                meta=dict(data.get("meta", {})),
            )
        except KeyError as exc:
            raise ValueError(f"{source}: missing key {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: malformed value ({exc})") from None
        if len(profile.compute_scale) != 2 or not 0.0 < profile.forward_fraction < 1.0:
            raise ValueError(f"{source}: compute_scale needs [encoder, llm] and forward_fraction must be in (0, 1)")
        if len(profile.load_s) != len(profile.tail_s) or not profile.tail_s:
            raise ValueError(f"{source}: load_s and tail_s need one value per stage")
        return profile

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON."""
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> EngineProfile:
        """Read a profile written by :meth:`save`; errors name the file."""
        return cls.from_dict(read_json_object(path), source=str(path))


# -- fitting ----------------------------------------------------------------------------------
def fit_compute_scale(steps: Sequence[EngineStep], shares: np.ndarray) -> list[float]:
    """Non-negative ``[encoder, llm]`` multipliers: measured stage time ~ sum of the scaled parts.

    A segment with no predicted time in the run (say, a text-only run's encoder) keeps 1.0.
    """
    shares = np.asarray(shares, dtype=float)
    rows, measured = [], []
    for step in steps:
        for s in range(shares.shape[0]):
            rows.append(step.costs * shares[s])
            measured.append(step.compute[:, s])
    design, target = np.concatenate(rows), np.concatenate(measured)
    used = design.sum(axis=0) > 0
    scale = np.ones(2)
    if used.any():
        from scipy.optimize import nnls  # a third of a second to import: only fitting needs it

        scale[used] = nnls(design[:, used], target)[0]
    return [float(x) for x in scale]


def _solve_increasing(error: Callable[[float], float], upper: float, iterations: int = 50) -> float:
    """The root in ``[0, upper]`` of an increasing function (0 if it is positive at 0, ``upper``
    if still negative there)."""
    if error(0.0) >= 0:
        return 0.0
    if error(upper) <= 0:
        return upper
    low, high = 0.0, upper
    for _ in range(iterations):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if error(mid) < 0 else (low, mid)
    return 0.5 * (low + high)


def fit_exchange_seconds(steps: Sequence[EngineStep], load_s: np.ndarray, tail_s: np.ndarray) -> float:
    """Seconds per blocking exchange at which the simulator, fed each step's measured compute
    (split by its measured forward share), load and tail, matches the mean measured step."""
    inputs = []
    for step in steps:
        forward, backward = step.totals["forward"], step.totals["backward"]
        share = np.where(forward + backward > 0, forward / np.maximum(forward + backward, 1e-12), 1.0 / 3.0)
        inputs.append((share * step.compute + load_s, (1.0 - share) * step.compute))
    measured = float(np.mean([step.step_s for step in steps]))

    def error(exchange: float) -> float:
        simulated = [simulate_1f1b(f, b, act_comm=exchange, allreduce=tail_s).step_time for f, b in inputs]
        return float(np.mean(simulated)) - measured

    n_exchanges = max(1, 2 * steps[0].compute.shape[0])
    return _solve_increasing(error, upper=measured / n_exchanges)


def fit_engine_profile(
    steps: Sequence[EngineStep], shares: np.ndarray, meta: dict[str, Any] | None = None
) -> EngineProfile:
    """Fit an :class:`EngineProfile` from a profiling run's measured steps and its stage shares."""
    if not steps:
        raise ValueError("fit_engine_profile needs at least one measured step")
    n_stages = steps[0].compute.shape[1]
    if any(step.compute.shape[1] != n_stages for step in steps) or np.asarray(shares).shape != (n_stages, 2):
        raise ValueError(f"every step needs {n_stages} stages and shares of shape ({n_stages}, 2)")
    totals = {
        kind: np.mean([step.totals.get(kind, np.zeros(n_stages)) for step in steps], axis=0)
        for kind in ("forward", "backward", "load", *TAIL_KINDS)
    }
    n_mb = float(np.mean([step.compute.shape[0] for step in steps]))
    load = totals["load"] / n_mb
    tail = sum(totals[kind] for kind in TAIL_KINDS)
    busy = totals["forward"] + totals["backward"]
    forward_fraction = float(totals["forward"].sum() / busy.sum()) if busy.sum() > 0 else 1.0 / 3.0
    return EngineProfile(
        compute_scale=fit_compute_scale(steps, shares),
        forward_fraction=forward_fraction,
        load_s=[float(x) for x in load],
        tail_s=[float(x) for x in tail],
        exchange_s=fit_exchange_seconds(steps, load, tail),
        meta={"steps": len(steps), "microbatches": n_mb, "machine": platform.machine(), **(meta or {})},
    )


# -- reading a run's telemetry ------------------------------------------------------------------
def read_engine_steps(
    telemetry: str | Path, shapes: Sequence[SampleShape], cost_model: CostModel, *, skip_steps: int = 3
) -> tuple[list[EngineStep], list[int]]:
    """The measured steps (data-parallel rank 0) of a telemetry JSONL written by
    :class:`~dflop_ds.telemetry.RuntimeTracker`, and the run's stage bounds.

    ``shapes`` is the run's dataset (indexed by the sample ids the records name) and
    ``cost_model`` predicts each microbatch. The first ``skip_steps`` steps (warm-up) are left out.
    """
    steps, bounds = [], None
    with open(telemetry, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{telemetry}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc})") from None
            if record.get("step", 0) < skip_steps:
                continue
            missing = [
                key
                for key in ("microbatches", "mb_observed", "stage_totals_s", "stage_bounds", "step_s")
                if key not in record
            ]
            if missing:
                raise ValueError(
                    f"{where}: telemetry record lacks {missing} (written by an older dflop-ds, "
                    "or a rank without the sampler's schedule)"
                )
            microbatches = record["microbatches"][0]
            try:
                costs = np.array([cost_model.predict_microbatch([shapes[i] for i in mb]) for mb in microbatches])
            except IndexError:
                raise ValueError(f"{where}: a sample id is outside the dataset of {len(shapes)} samples") from None
            observed = np.asarray(record["mb_observed"], dtype=float)[:, : len(microbatches)].T
            totals = {kind: np.asarray(v, dtype=float) for kind, v in record["stage_totals_s"].items()}
            steps.append(EngineStep(costs, observed, totals, float(record["step_s"])))
            bounds = [int(b) for b in record["stage_bounds"]]
    if not steps or bounds is None:
        raise ValueError(f"{telemetry}: no telemetry record after the first {skip_steps} steps")
    return steps, bounds


def engine_profile_from_run(
    telemetry: str | Path, shapes: Sequence[SampleShape], cost_model: LayeredCostModel, *, skip_steps: int = 3
) -> EngineProfile:
    """Fit an :class:`EngineProfile` from a profiling run's telemetry JSONL (see :func:`read_engine_steps`)."""
    steps, bounds = read_engine_steps(telemetry, shapes, cost_model, skip_steps=skip_steps)
    shares = stage_shares(bounds, cost_model)
    profile = fit_engine_profile(
        steps, shares, meta={"source": str(telemetry), "stage_bounds": bounds, "skip_steps": skip_steps}
    )
    # how well the profile, fed cost-model predictions, reproduces the run it came from
    simulated = [profile.simulate(step.costs, shares).step_time for step in steps]
    profile.meta.update(
        measured_mean_step_s=float(np.mean([step.step_s for step in steps])),
        simulated_mean_step_s=float(np.mean(simulated)),
    )
    return profile


__all__ = [
    "EngineProfile",
    "EngineStep",
    "engine_profile_from_run",
    "fit_compute_scale",
    "fit_engine_profile",
    "fit_exchange_seconds",
    "read_engine_steps",
]
