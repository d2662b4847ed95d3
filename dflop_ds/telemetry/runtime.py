"""Runtime measurement and adaptive correction inside a DeepSpeed pipeline training loop.

:class:`RuntimeTracker` is called by *every* rank at the same two points of every step::

    tracker.start_step()
    loss = engine.train_batch(data_iter)
    record = tracker.end_step(step, step_seconds, loss)   # collective over the world group

``end_step`` all-gathers one small fixed-size vector per rank (its stage's per-microbatch
compute/wait times, and, while the correction tracks, the step's microbatch composition by
shape bucket from a rank that ran the sampler), so every rank, middle stages included, sees the
same observation, updates the correction identically and publishes it as version
``step + 1``. The sampler's background thread only reads published versions.

A step's record (one JSON line, rank 0) holds, besides the balance figures: ``mb_observed`` and
``mb_wait``, ``(stages, dp * n_mb)`` forward+backward and send+receive seconds per microbatch;
on a CPU device ``mb_observed_cpu``, the same forward+backward in CPU seconds of the computing
thread (:func:`~dflop_ds.telemetry.timers.compute_cpu_clock`), which other processes on a shared
machine do not inflate;
``stage_totals_s``, instruction kind -> seconds per stage over the step (data-parallel mean);
``stage_bounds``, the layer split; ``microbatches``, the sample ids of every data-parallel
rank's microbatches (when the sampler ran on rank 0). :mod:`dflop_ds.plan.engine_profile` fits an
engine profile from these.
"""

from __future__ import annotations

import json
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dflop_ds.paths import check_writable
from dflop_ds.schedule.correction import CostCorrection, StepObservation, composition
from dflop_ds.telemetry.record import bubble_fraction, imbalance, log_line, monitor_events, observed_imbalance
from dflop_ds.telemetry.timers import STEP_KINDS, PipelineTimer, StageTiming, compute_cpu_clock

HEADER = 7  # has_schedule, stage, dp_rank, step_s, timer_overhead_s, tracking_overhead_s, schedule fingerprint


class RuntimeTracker:
    """Measures each step, feeds the correction, writes telemetry (rank 0).

    Args:
        engine: the DeepSpeed ``PipelineEngine``.
        sampler: this rank's dflop-ds batch sampler (its ``last_schedule`` is read on ranks that
            iterate it: first and last stages).
        correction: optional :class:`CostCorrection` (the sampler's ``cost_adjuster``).
        jsonl_path: where rank 0 appends one JSON record per step (None: nowhere); checked for
            writing here, before the first step.
        run_id: tags every record, so runs appended to one log stay apart (default: a new
            time-stamped id; give every rank the same one).
        log: print the concise line on rank 0.
        timer: the :class:`PipelineTimer` (default: installed on ``engine``).
    """

    def __init__(
        self,
        engine,
        sampler,
        correction: CostCorrection | None = None,
        *,
        jsonl_path: str | None = None,
        log: bool = True,
        timer: PipelineTimer | None = None,
        run_id: str | None = None,
    ) -> None:
        from deepspeed.accelerator import get_accelerator

        self.engine = engine
        self.sampler = sampler
        self.correction = correction
        self.n_mb = int(engine.gradient_accumulation_steps())
        self.n_stages = int(engine.num_stages)
        self.stage = int(engine.stage_id)
        self.dp = int(engine.grid.get_data_parallel_world_size())
        self.dp_rank = int(engine.grid.get_data_parallel_rank())
        self.rank = dist.get_rank()
        accelerator = get_accelerator()
        self.device = accelerator.current_device_name()
        on_cpu = accelerator.device_name() == "cpu"
        sync = None if on_cpu else accelerator.synchronize
        cpu_clock = compute_cpu_clock(torch.get_num_threads()) if on_cpu else None
        self.timer = timer or PipelineTimer(engine, self.n_mb, synchronize=sync, cpu_clock=cpu_clock).install()
        self.jsonl_path = Path(jsonl_path) if jsonl_path else None
        if self.jsonl_path is not None and self.rank == 0:
            check_writable(self.jsonl_path, "telemetry log")
        self.run_id = run_id or new_run_id()
        self.log = log
        self.buckets = correction.scheme.buckets(sampler.shapes) if correction is not None else None
        self._tracking_overhead_s = 0.0
        if correction is not None and correction.published_versions() == []:
            correction.publish(0)

    # -- the two calls of the training loop -----------------------------------------------------
    def start_step(self) -> None:
        """Call right before ``engine.train_batch``."""
        self.timer.start_step()

    def end_step(self, step: int, step_s: float, loss: float | None = None) -> dict[str, Any]:
        """Call right after ``engine.train_batch`` on every rank; returns the step's record."""
        begin = time.perf_counter()
        timing = self.timer.finish_step()
        tracking = self.correction is not None and self.correction.tracking()
        sched = self.sampler.last_schedule if self.sampler is not None else None
        rows = self._gather(self._local_vector(timing, step_s, sched, self.correction if tracking else None))
        check_same_schedule(rows, step)
        gathered = time.perf_counter()
        stage_times, waits, step_max = self._stage_arrays(rows, 0), self._stage_arrays(rows, 1), float(rows[:, 3].max())
        update_s = 0.0
        if self.correction is not None:
            update_s = self._feed_correction(self.correction, rows, stage_times, tracking)
            self.correction.publish(step + 1)
        record = self._record(step, step_s, loss, rows, stage_times, waits, step_max, sched)
        elapsed = time.perf_counter() - begin
        record["telemetry_overhead_s"] = float(rows[:, 4].max()) + (elapsed - update_s)
        record["telemetry_overhead_frac"] = record["telemetry_overhead_s"] / max(step_max, 1e-12)
        if tracking:
            self._tracking_overhead_s = (gathered - begin) + update_s
        self._write(record, step)
        return record

    def close(self) -> None:
        """Restore the engine's instruction table."""
        self.timer.uninstall()

    # -- pieces --------------------------------------------------------------------------------
    def _totals_columns(self) -> slice:
        """Where a gathered row holds the step's per-kind totals (after header, compute, wait, load,
        CPU compute)."""
        start = HEADER + 4 * self.n_mb
        return slice(start, start + len(STEP_KINDS))

    def _comp_size(self, correction: CostCorrection) -> int:
        return self.dp * self.n_mb * correction.n_columns * correction.scheme.n_buckets

    def _local_vector(self, timing: StageTiming, step_s: float, sched, tracked: CostCorrection | None) -> np.ndarray:
        """This rank's row of the step: header, per-microbatch times, totals and, when a correction
        is ``tracked``, the step's microbatch composition."""
        fingerprint = zlib.crc32(json.dumps(sched.split.ranks).encode()) if sched is not None else -1
        head = [
            float(sched is not None),
            self.stage,
            self.dp_rank,
            step_s,
            timing.overhead_s,
            self._tracking_overhead_s,
            float(fingerprint),
        ]
        totals = [timing.totals.get(kind, 0.0) for kind in STEP_KINDS]
        cpu = timing.compute_cpu if timing.compute_cpu is not None else np.full(self.n_mb, np.nan)
        parts = [np.asarray(head, dtype=float), timing.compute, timing.wait, timing.per_mb["load"], cpu]
        parts.append(np.asarray(totals))
        if tracked is not None and self.buckets is not None:
            comp = np.zeros(self._comp_size(tracked))
            if sched is not None:
                microbatches = [mb for rank in sched.split.ranks for mb in rank]
                comp = composition(microbatches, self.sampler.costs, self.buckets, tracked.scheme.n_buckets).ravel()
            parts.append(comp)
        return np.concatenate(parts)

    def _gather(self, vector: np.ndarray) -> np.ndarray:
        """``(world, len)``: every rank's vector, identical on all ranks."""
        local = torch.as_tensor(vector, dtype=torch.float64, device=self.device)
        out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(out, local)
        return torch.stack(out).cpu().numpy()

    def _stage_arrays(self, rows: np.ndarray, block: int = 0) -> np.ndarray:
        """``(stages, dp * n_mb)``: the ``block``-th per-microbatch block of every rank's row
        (0 compute, 1 wait, 2 load, 3 CPU compute), NaN where no rank reported."""
        n = self.n_mb
        out = np.full((self.n_stages, self.dp * n), np.nan)
        start = HEADER + block * n
        for row in rows:
            s, d = int(row[1]), int(row[2])
            out[s, d * n : (d + 1) * n] = row[start : start + n]
        return out

    def _feed_correction(
        self, correction: CostCorrection, rows: np.ndarray, stage_times: np.ndarray, tracking: bool
    ) -> float:
        start = time.perf_counter()
        if not tracking:
            correction.skip()
            return time.perf_counter() - start
        with_schedule = np.flatnonzero(rows[:, 0] > 0)
        if with_schedule.size == 0:
            raise RuntimeError("no rank reported a schedule: is the sampler iterated on the first/last stages?")
        offset = self._totals_columns().stop
        comp = rows[with_schedule[0], offset : offset + self._comp_size(correction)].reshape(
            self.dp * self.n_mb, correction.n_columns, correction.scheme.n_buckets
        )
        obs = StepObservation(comp, stage_times, overhead_s=float(rows[:, 5].max()), microbatches_per_rank=self.n_mb)
        correction.update(obs)
        return time.perf_counter() - start

    def _record(self, step, step_s, loss, rows, stage_times, waits, step_max, sched) -> dict[str, Any]:
        per_stage, overall = observed_imbalance(stage_times)
        compute_per_rank = np.array([row[HEADER : HEADER + self.n_mb].sum() for row in rows])
        wait_per_rank = np.array([row[HEADER + self.n_mb : HEADER + 2 * self.n_mb].sum() for row in rows])
        record: dict[str, Any] = {
            "run_id": self.run_id,
            "step": int(step),
            "step_s": step_max,
            "loss": None if loss is None else float(loss),
            "imbalance_observed": overall,
            "imbalance_observed_stages": per_stage,
            "bubble_fraction": bubble_fraction(compute_per_rank, step_max),
            "wait_fraction": float(wait_per_rank.mean() / step_max) if step_max > 0 else float("nan"),
            "stage_compute_s": np.nansum(stage_times, axis=1).tolist(),
            "stage_wait_s": np.nansum(waits, axis=1).tolist(),
            "mb_observed": np.where(np.isfinite(stage_times), stage_times, -1.0).tolist(),
            "mb_wait": np.where(np.isfinite(waits), waits, -1.0).tolist(),
            "stage_totals_s": self._stage_totals(rows),
            "stage_bounds": [int(b) for b in getattr(self.engine.module, "parts", [])],
        }
        cpu_times = self._stage_arrays(rows, 3)
        if np.isfinite(cpu_times).any():
            record["mb_observed_cpu"] = np.where(np.isfinite(cpu_times), cpu_times, -1.0).tolist()
        if sched is not None:
            predicted = sched.split.predicted.reshape(-1, sched.split.predicted.shape[-1])
            columns = [imbalance(predicted[:, c]) for c in range(predicted.shape[1])]
            busiest = int(predicted.sum(axis=0).argmax())
            record.update(
                imbalance_predicted=columns[busiest],
                imbalance_predicted_columns=columns,
                schedule_ms=1e3 * sched.schedule_s,
                solver=sched.split.solver,
                solver_exact=float(sched.split.solver.startswith("ilp")),
                sync=str(sched.split.sync),
                step_predicted=sched.split.step,
                step_bound=sched.split.lower_bound,
                mb_predicted=predicted.tolist(),
                microbatches=[[[int(i) for i in mb] for mb in rank] for rank in sched.split.ranks],
            )
            record["predicted_space"] = "stage" if self._stage_space(step) else "model"
            if record["predicted_space"] == "model":
                record.update(imbalance_predicted_encoder=columns[0], imbalance_predicted_llm=columns[-1])
        if self.correction is not None:
            summary = self.correction.summary()
            record.update(
                correction_active=summary["active"],
                correction_tracking=summary["tracking"],
                correction_gain_s=summary["gain_s"],
                correction_overhead_s=summary["overhead_s"],
                correction_penalty=summary["penalty"],
                correction_penalty_where=summary["penalty_where"],
            )
        return record

    def _stage_totals(self, rows: np.ndarray) -> dict[str, list[float]]:
        """Instruction kind -> seconds per stage over the step (mean over data-parallel ranks)."""
        columns = self._totals_columns()
        totals = np.zeros((self.n_stages, len(STEP_KINDS)))
        for row in rows:
            totals[int(row[1])] += row[columns] / self.dp
        return {kind: totals[:, k].tolist() for k, kind in enumerate(STEP_KINDS)}

    def _stage_space(self, step: int) -> bool:
        """Whether the step's batch was scheduled on per-stage costs: corrected seconds, or a cost
        model predicting per stage (``per_stage``)."""
        if self.sampler is not None and self.sampler.cost_model.per_stage:
            return True
        if self.correction is None:
            return False
        version = step - getattr(self.sampler, "prefetch", 0) - 1
        snap = self.correction.snapshot_of(version)
        return bool(snap is not None and snap.active)

    def _write(self, record: dict[str, Any], step: int) -> None:
        if self.rank != 0:
            return
        monitor = getattr(self.engine, "monitor", None)
        if monitor is not None and getattr(monitor, "enabled", False):
            monitor.write_events(monitor_events(record, step))
        if self.jsonl_path is not None:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.jsonl_path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
        if self.log:
            print(log_line(record), flush=True)


def new_run_id() -> str:
    """A fresh run id: start time and a random suffix, e.g. ``20261123T101500-3f9a2c``."""
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


def check_same_schedule(rows: np.ndarray, step: int) -> None:
    """Raise if ranks that ran the sampler scheduled the step's global batch differently."""
    prints = {int(row[6]) for row in rows if row[0] > 0}
    if len(prints) > 1:
        ranks = [i for i, row in enumerate(rows) if row[0] > 0]
        raise RuntimeError(
            f"step {step}: ranks {ranks} computed different schedules (fingerprints {sorted(prints)}); "
            "the sampler or its cost adjuster is not deterministic across ranks"
        )


def default_jsonl_path(ds_config: dict) -> str | None:
    """``<csv_monitor.output_path>/<job_name>/dflop_telemetry.jsonl`` when the CSV monitor is on."""
    csv = ds_config.get("csv_monitor") or {}
    if not csv.get("enabled"):
        return None
    return str(Path(csv.get("output_path") or ".") / csv.get("job_name", "DeepSpeedJobName") / "dflop_telemetry.jsonl")
