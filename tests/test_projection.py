"""`dflop-ds project`: every method on its best plan, DFLOP's gain, the cost model and the simulator's error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from dflop_ds.commands.main import main
from dflop_ds.cost import FittedCostModel, PackedView, reference_model, save_cost_model
from dflop_ds.data import read_dataset
from dflop_ds.plan import Cluster
from dflop_ds.plan.calibration import DOCUMENTED, load_calibration, save_calibration
from dflop_ds.plan.projection import (
    METHODS,
    encoder_share,
    project_size,
    table_lines,
    with_encoder_share,
)
from dflop_ds.shapes import ShapePolicy
from tests.test_costmodel import synthetic_profile

MODEL = "llava-ov-0.5b-a100"


def records(n: int, seed: int = 0) -> list[dict]:
    """A small mixed data set: text-only chats, single and multi-image samples, short videos."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        record: dict = {"id": f"r{i}", "text_tokens": int(rng.integers(20, 900)), "label_tokens": 8}
        kind = i % 4
        if kind == 1:
            record["images"] = [[int(rng.integers(300, 1500)), int(rng.integers(300, 1500))]]
        elif kind == 2:
            record["images"] = [[640, 480]] * int(rng.integers(2, 5))
        elif kind == 3:
            record["video_frames"] = int(rng.integers(40, 600))
        out.append(record)
    return out


@pytest.fixture
def data(tmp_path: Path, write_jsonl) -> Path:
    return write_jsonl(tmp_path / "tiny.jsonl", records(48))


def test_project_prints_every_method_and_the_gain(data: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # no out/simulator_calibration.json here: the documented figures
    png = tmp_path / "gain.png"
    argv = ["project", "--cost-model", MODEL, "--data", str(data), "--gpus", "8", "16", "--batches", "2"]
    assert main([*argv, "--png", str(png)]) == 0
    out = capsys.readouterr().out
    own = [line for line in out.splitlines() if not line.startswith("[")]  # DeepSpeed's log lines start "[date"
    assert own[0].startswith("PREDICTION, not a measurement: cost model llava-ov-0.5b-a100 (analytic")
    assert "from docs/benchmarks.md" in out and f"{DOCUMENTED.error:.1%} pipelined" in out
    assert "simulator has not been checked against a GPU run" in out
    for gpus in (8, 16):
        for method in METHODS:
            numbers = r"\s+\d+\.\d+ \(\d+\.\d+-\d+\.\d+\)\s+\d+\.\d\s+E\("  # step (min-max) samples/s plan
            row = rf"^\s+{gpus}\s+{2 * gpus}\s+{re.escape(method.label)}{numbers}"
            assert re.search(row, out, re.MULTILINE), (method.label, gpus, out)
    gains = re.findall(r"DFLOP over the best baseline \((.+?)\): x(\d+\.\d+) \(x(\d+\.\d+)-(\d+\.\d+) over 2", out)
    assert len(gains) == 2, out
    for label, gain, low, high in gains:
        assert label in {m.label for m in METHODS if m.name != "dflop"}
        assert float(low) <= float(gain) <= float(high)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_method_runs_its_own_split_and_the_gain_is_over_the_fastest(data: Path) -> None:
    shapes = list(read_dataset(data, ShapePolicy()))
    model = reference_model(MODEL)
    size = project_size(model, Cluster(gpus=8, gpu_memory_bytes=80e9), shapes, 32, n_batches=2)
    assert [m.method.name for m in size.methods] == [m.name for m in METHODS]
    for m in size.methods:
        assert m.layout is not None and len(m.step_times) == 2
        assert m.layout.splitter == m.method.splitter
    baselines = [m for m in size.methods if m.method.name != "dflop"]
    fastest = min(baselines, key=lambda m: m.step_time)
    assert size.best_baseline is fastest
    assert size.gain == pytest.approx(fastest.step_time / size.of("dflop").step_time)
    assert size.of("dflop").samples_per_s == pytest.approx(32 / size.of("dflop").step_time)


def test_packed_microbatches_cost_their_samples_and_padded_ones_more(data: Path) -> None:
    shapes = list(read_dataset(data, ShapePolicy()))[:6]
    model = reference_model(MODEL)
    packed = PackedView(model)
    assert packed.predict_microbatch(shapes) == pytest.approx(model.predict_samples(shapes).sum(axis=0))
    assert packed.predict_microbatch(shapes)[1] < model.predict_microbatch(shapes)[1]  # no padding
    assert packed.predict_activation_bytes(shapes)[1] < model.predict_activation_bytes(shapes)[1]
    assert packed.encoder_layers == model.encoder_layers  # the rest is the model's


@pytest.mark.parametrize("share", [0.1, 0.25, 0.5])
def test_the_encoder_share_is_scaled_to_the_target(data: Path, share: float) -> None:
    shapes = list(read_dataset(data, ShapePolicy()))
    model = reference_model(MODEL)
    scaled = with_encoder_share(model, shapes, share)
    assert encoder_share(scaled, shapes) == pytest.approx(share)
    assert scaled.predict_microbatch(shapes[:3])[1] == model.predict_microbatch(shapes[:3])[1]
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        with_encoder_share(model, shapes, 1.0)


def test_calibration_reads_the_last_validation_run(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    figures = {"error": 0.05, "cost_model_only": 0.1, "colocated_error": 0.07, "colocated_cost_model_only": 0.2}
    save_calibration(path, figures, measured="26 Nov 2026 12:00 UTC", machine="2 GPU ranks, tiny model")
    calibration = load_calibration(path)
    assert (calibration.error, calibration.colocated_error, calibration.source) == (0.05, 0.07, str(path))
    assert "5.0% pipelined" in calibration.describe() and "not been checked against a GPU" not in calibration.describe()
    path.write_text(json.dumps({"error": 0.1}))
    with pytest.raises(ValueError, match=r"calibration\.json: not a simulator calibration record \(missing"):
        load_calibration(path)
    path.write_text("root:x:0:0:root:/root:/bin/bash\n")  # not JSON at all: the file is named
    with pytest.raises(ValueError, match=r"calibration\.json"):
        load_calibration(path)


def test_a_size_nothing_fits_has_no_plans_and_no_gain(data: Path) -> None:
    shapes = list(read_dataset(data, ShapePolicy()))
    model = reference_model("llava-ov-72b-h100")  # 72B's training state needs more than 8 x 80 GB
    size = project_size(model, Cluster(gpus=8, gpu_memory_bytes=80e9), shapes, 16, n_batches=1)
    assert all(m.layout is None and not m.step_times for m in size.methods)
    assert size.best_baseline is None and np.isnan(size.gain)
    assert "DFLOP over the best baseline: n/a (no baseline plan fits)" in "\n".join(table_lines([size]))


def test_project_runs_on_a_profiled_cost_model_file(tmp_path: Path, write_jsonl, capsys) -> None:
    path = tmp_path / "profiled.json"
    save_cost_model(FittedCostModel().fit(synthetic_profile()), path)
    data = write_jsonl(tmp_path / "tiny.jsonl", records(24, seed=3))
    argv = ["project", "--cost-model", str(path), "--data", str(data), "--policy", "tiny", "--gpus", "2"]
    assert main([*argv, "--batches", "1", "--gpu-memory-gb", "24"]) == 0
    out = capsys.readouterr().out
    assert f"cost model {path} (FittedCostModel) (measured)" in out
    assert re.search(r"DFLOP over the best baseline \(.+\): x\d+\.\d+", out), out


@pytest.mark.parametrize(("zero_stage", "sync"), [(1, "boundary"), (3, "module")])
def test_project_zero_stage_picks_the_sync_model_and_prints_it(data: Path, capsys, zero_stage, sync) -> None:
    argv = ["project", "--cost-model", MODEL, "--data", str(data), "--gpus", "8", "--batches", "1"]
    assert main([*argv, "--zero-stage", str(zero_stage)]) == 0
    out = capsys.readouterr().out
    assert re.search(
        rf"^sync model \(ZeRO-{zero_stage}, one stage; every method scored under it.*\): {sync}: ", out, re.M
    )


def test_project_restricts_every_methods_tp_and_microbatches_alike(data: Path, capsys) -> None:
    argv = ["project", "--cost-model", MODEL, "--data", str(data), "--gpus", "8", "--batches", "1"]
    assert main([*argv, "--zero-stage", "3", "--max-tp", "1", "--microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert "every method's plan restricted alike: tensor parallelism at most 1, 2 microbatches per GPU" in out
    rows = [line for line in out.splitlines() if re.match(r"^\s+8\s+16\s", line)]
    assert len(rows) == len(METHODS), out
    assert all("L(tp1,pp1,dp8) mb2" in row for row in rows), rows


def test_under_zero3_every_method_is_scored_per_module(data: Path) -> None:
    """ZeRO-3 runs no pipeline: every method's single-stage step is its microbatches' step under
    the ``module`` sync model plus the gradient communication, recomputed here from its split
    (DFLOP's colocated layout, when it wins, adds its encoder phase apart)."""
    from dflop_ds.plan.evaluate import _stats
    from dflop_ds.plan.planner import simulate_layout
    from dflop_ds.plan.search import sample_batches
    from dflop_ds.sync import SyncModel, step_cost

    shapes = list(read_dataset(data, ShapePolicy()))
    model = reference_model(MODEL)
    cluster = Cluster(gpus=8, gpu_memory_bytes=80e9, zero_stage=3, max_tp=1)
    size = project_size(model, cluster, shapes, 32, n_batches=1)
    batch = [shapes[j] for j in sample_batches(len(shapes), 32, 1, seed=0)[0]]  # the projection's batch
    for m in size.methods:
        assert m.layout is not None and m.layout.n_stages == 1, m.method.name
        if m.layout.colocated:  # its encoder phase runs apart (tests/test_plan_sync.py)
            continue
        view = PackedView(model) if m.method.packed else model
        [evaluation] = simulate_layout(view, cluster, m.layout, shapes, 32)
        times = _stats(view, batch, evaluation.order).time
        reduction = float(evaluation.sim.allreduce.max())
        assert m.step_times[0] == pytest.approx(step_cost(times, SyncModel.MODULE) + reduction), m.method.name
