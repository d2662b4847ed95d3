"""Telemetry: instruction timers on an engine-like object driven by DeepSpeed's own 1F1B schedule,
per-step figures, monitor events, the log line, and ``dflop-ds report``."""

from __future__ import annotations

import json
import math
import time
from types import MethodType

import numpy as np
import pytest
from deepspeed.runtime.pipe import schedule

from dflop_ds.commands.main import main as cli_main
from dflop_ds.telemetry import PipelineTimer, bubble_fraction, imbalance, log_line, monitor_events, observed_imbalance
from dflop_ds.telemetry.report import read_log, scatter_points, split_runs, summarize
from dflop_ds.telemetry.timers import compute_cpu_clock

FORWARD_S = [0.02, 0.06, 0.01, 0.04]  # per microbatch: long enough that a loaded machine's sleep overrun stays small


class FakeEngine:
    """Dispatches instructions exactly like ``PipelineEngine._exec_schedule``; forward of the k-th
    microbatch sleeps ``FORWARD_S[k]``, backward twice that."""

    def _exec_forward_pass(self, buffer_id):
        time.sleep(FORWARD_S[self.forwards])
        self.forwards += 1

    def _exec_backward_pass(self, buffer_id):
        time.sleep(2 * FORWARD_S[self.backwards])
        self.backwards += 1

    def _nothing(self, **kwargs):
        pass

    _INSTRUCTION_MAP = {
        schedule.ForwardPass: _exec_forward_pass,
        schedule.BackwardPass: _exec_backward_pass,
        schedule.LoadMicroBatch: _nothing,
        schedule.SendActivation: _nothing,
        schedule.RecvActivation: _nothing,
        schedule.SendGrad: _nothing,
        schedule.RecvGrad: _nothing,
        schedule.ReduceGrads: _nothing,
        schedule.ReduceTiedGrads: _nothing,
        schedule.OptimizerStep: _nothing,
    }

    def run(self, stage_id: int, stages: int = 2) -> None:
        self.forwards = self.backwards = 0
        for step_cmds in schedule.TrainSchedule(micro_batches=len(FORWARD_S), stages=stages, stage_id=stage_id):
            for cmd in step_cmds:
                MethodType(self._INSTRUCTION_MAP[type(cmd)], self)(**cmd.kwargs)


@pytest.mark.parametrize("stage_id", [0, 1])
def test_timer_charges_each_microbatch_its_own_forward_and_backward(stage_id):
    engine = FakeEngine()
    timer = PipelineTimer(engine, micro_batches=len(FORWARD_S)).install()
    assert (
        "_INSTRUCTION_MAP" in vars(engine)
        and FakeEngine._INSTRUCTION_MAP[schedule.ForwardPass] is FakeEngine._exec_forward_pass
    )  # the class table is untouched
    timer.start_step()
    engine.run(stage_id)
    timing = timer.finish_step()
    np.testing.assert_allclose(timing.per_mb["forward"], FORWARD_S, atol=0.008, rtol=0.5)
    np.testing.assert_allclose(timing.per_mb["backward"], 2 * np.array(FORWARD_S), atol=0.008, rtol=0.5)
    assert int(np.argmax(timing.compute)) == 1 and int(np.argmin(timing.compute)) == 2
    assert timing.totals["forward"] == pytest.approx(timing.per_mb["forward"].sum())
    assert 0 < timing.overhead_s < 0.02
    timer.uninstall()
    assert "_INSTRUCTION_MAP" not in vars(engine)


class ChargedEngine(FakeEngine):
    """:class:`FakeEngine` whose passes also advance a virtual CPU-time clock (``cpu_seconds``) by
    known amounts: microbatch ``k``'s forward by ``10 (k + 1)`` s, its backward by twice that."""

    cpu_seconds = 0.0

    def _exec_forward_pass(self, buffer_id):
        self.cpu_seconds += 10.0 * (self.forwards + 1)
        FakeEngine._exec_forward_pass(self, buffer_id)

    def _exec_backward_pass(self, buffer_id):
        self.cpu_seconds += 20.0 * (self.backwards + 1)
        FakeEngine._exec_backward_pass(self, buffer_id)

    _INSTRUCTION_MAP = {
        **FakeEngine._INSTRUCTION_MAP,
        schedule.ForwardPass: _exec_forward_pass,
        schedule.BackwardPass: _exec_backward_pass,
    }


@pytest.mark.parametrize("stage_id", [0, 1])
def test_cpu_clock_charges_each_microbatch_its_own_passes(stage_id):
    engine = ChargedEngine()
    timer = PipelineTimer(engine, micro_batches=len(FORWARD_S), cpu_clock=lambda: engine.cpu_seconds).install()
    timer.start_step()
    engine.run(stage_id)
    timing = timer.finish_step()
    np.testing.assert_allclose(timing.compute_cpu, 30.0 * (np.arange(len(FORWARD_S)) + 1))
    assert timing.per_mb["forward"].sum() >= sum(FORWARD_S)  # wall time still recorded


def test_thread_cpu_time_leaves_out_waiting_that_wall_time_counts():
    engine = FakeEngine()  # its passes sleep: wall time, no compute
    timer = PipelineTimer(engine, micro_batches=len(FORWARD_S), cpu_clock=compute_cpu_clock(1)).install()
    timer.start_step()
    engine.run(0)
    timing = timer.finish_step()
    assert timing.compute.sum() > 0.08
    assert timing.compute_cpu.sum() < 0.2 * timing.compute.sum()
    assert PipelineTimer(engine, micro_batches=1).install().finish_step().compute_cpu is None  # no CPU clock
    assert compute_cpu_clock(1) is time.thread_time and compute_cpu_clock(4) is time.process_time


def test_timer_overhead_is_small_per_instruction():
    engine = FakeEngine()
    timer = PipelineTimer(engine, micro_batches=len(FORWARD_S)).install()
    wrapped = engine._INSTRUCTION_MAP[schedule.ReduceGrads]
    timer.start_step()
    for _ in range(2000):
        wrapped(engine)
    per_call = timer.finish_step().overhead_s / 2000
    assert per_call < 5e-5, per_call


def test_step_figures():
    assert imbalance(np.array([1.0, 1.0, 2.0, 0.0])) == pytest.approx(2.0)
    assert math.isnan(imbalance(np.array([np.nan])))
    stages, overall = observed_imbalance(np.array([[1.0, 3.0], [5.0, 5.0]]))
    assert stages == pytest.approx([1.5, 1.0]) and overall == pytest.approx(1.0)  # stage 1 is the busiest
    assert bubble_fraction(np.array([6.0, 8.0]), 10.0) == pytest.approx(0.3)


def test_monitor_events_keep_finite_numbers_and_the_log_line_shows_the_figures():
    record = {
        "step": 7,
        "step_s": 1.5,
        "imbalance_observed": 1.25,
        "imbalance_predicted": float("nan"),
        "correction_active": True,
        "correction_tracking": True,
        "correction_gain_s": 0.2,
        "correction_overhead_s": 0.001,
        "correction_penalty": 3.0,
        "solver": "lpt+moves",
        "schedule_ms": 2.0,
        "bubble_fraction": 0.31,
        "telemetry_overhead_frac": 0.004,
    }
    events = dict((name, value) for name, value, step in monitor_events(record, 7))
    assert events["dflop/imbalance_observed"] == 1.25 and events["dflop/correction_active"] == 1.0
    assert "dflop/imbalance_predicted" not in events
    assert all(step == 7 for _, _, step in monitor_events(record, 7))
    line = log_line(record)
    for text in ("step   7", "obs 1.250", "pred -", "lpt+moves", "correction on", "max-penalty 3.00", "0.40%"):
        assert text in line, (text, line)


def _write_log(path, steps=6):
    with open(path, "w") as handle:
        for step in range(steps):
            active = step >= 3
            predicted = [[0.1 * (m + 1), 0.2] for m in range(4)] if active else [[m + 1.0, 10.0] for m in range(4)]
            handle.write(
                json.dumps(
                    {
                        "step": step,
                        "step_s": 1.0,
                        "imbalance_observed": 1.5 - 0.1 * step,
                        "imbalance_predicted": 1.1,
                        "correction_active": active,
                        "predicted_space": "stage" if active else "model",
                        "solver": "lpt",
                        "mb_predicted": predicted,
                        "mb_observed": [[0.1 * (m + 1) for m in range(4)], [0.2, 0.2, -1.0, 0.2]],
                    }
                )
                + "\n"
            )


def test_report_reads_a_log_and_writes_plots(tmp_path, capsys):
    run = tmp_path / "monitor" / "job"
    run.mkdir(parents=True)
    _write_log(run / "dflop_telemetry.jsonl")
    assert cli_main(["report", str(tmp_path / "monitor"), "--out", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "6 steps" in out and "median_imbalance_observed" in out
    assert (tmp_path / "plots" / "imbalance.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "predicted_vs_observed.png").stat().st_size > 1000
    records = read_log(run / "dflop_telemetry.jsonl")
    points = scatter_points(records)
    assert len(points[0][0]) == 3 * 4 and len(points[1][0]) == 3 * 3  # stage-space steps only, unobserved dropped
    np.testing.assert_allclose(points[0][0], points[0][1])
    assert summarize(records)["correction_active_steps"] == 3


def test_report_splits_runs_appended_to_one_log(tmp_path, capsys):
    log = tmp_path / "dflop_telemetry.jsonl"
    _write_log(log, steps=4)
    with open(log, "a") as handle:
        handle.write(open(log).read().splitlines()[0] + "\n")  # a second run: step 0 again
    assert [len(run) for run in split_runs(read_log(log))] == [4, 1]
    assert cli_main(["report", str(log), "--run-index", "0", "--out", str(tmp_path)]) == 0
    assert "run 1 of 2, 4 steps" in capsys.readouterr().out
    assert cli_main(["report", str(log), "--run-index", "5"]) == 1


def test_report_separates_runs_by_run_id_and_selects_one(tmp_path, capsys):
    log = tmp_path / "dflop_telemetry.jsonl"
    _write_log(log, steps=4)
    lines = log.read_text().splitlines()
    tagged = [
        json.dumps({**json.loads(line), "run_id": "first" if i < 2 else "resumed"}) for i, line in enumerate(lines)
    ]
    log.write_text("\n".join(tagged) + "\n")  # steps 0, 1 then a resumed run's 2, 3: steps alone would merge them
    assert [[r["step"] for r in run] for run in split_runs(read_log(log))] == [[0, 1], [2, 3]]
    assert cli_main(["report", str(log), "--run-id", "first", "--out", str(tmp_path)]) == 0
    assert "run 1 of 2 (run_id first), 2 steps" in capsys.readouterr().out
    assert cli_main(["report", str(log), "--run-id", "other"]) == 1
    assert "no run with id 'other'" in capsys.readouterr().err


def test_report_names_a_bad_line_and_tolerates_an_unfinished_last_one(tmp_path, capsys):
    log = tmp_path / "dflop_telemetry.jsonl"
    log.write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    assert cli_main(["report", str(log)]) == 1
    assert "dflop_telemetry.jsonl:2" in capsys.readouterr().err
    log.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "imbal')  # a run killed mid-write
    with pytest.warns(UserWarning, match=":3: left out an unfinished last record"):
        assert [r["step"] for r in read_log(log)] == [0, 1]
    assert cli_main(["report", str(tmp_path / "nowhere")]) == 1
