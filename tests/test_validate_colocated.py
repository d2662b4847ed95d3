"""validate-simulator's colocated case: reading a traced run and replaying it with the planner's simulation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from test_plan_file import _shapes  # noqa: E402

from benchmarks.validate_simulator import local_compute_seconds, read_traced_steps  # noqa: E402
from dflop_ds.cost import reference_model  # noqa: E402
from dflop_ds.plan import Cluster, Segment  # noqa: E402
from dflop_ds.plan.families.colocated import colocated_step  # noqa: E402
from dflop_ds.plan.layout import Layout  # noqa: E402


def _write_run(tmp_path: Path, steps: dict[int, list]) -> tuple[Path, Path]:
    trace, summary = tmp_path / "trace.jsonl", tmp_path / "summary.json"
    lines = [
        json.dumps({"step": k, "dp_rank": r, "microbatches": ranks[r]}) for k, ranks in steps.items() for r in (1, 0)
    ]  # ranks append in any order
    trace.write_text("\n".join(lines) + "\n")
    summary.write_text(json.dumps({"steps": [{"step": k, "step_s": 1.0 + k} for k in steps]}))
    return trace, summary


def test_traced_steps_pair_each_measured_step_with_every_ranks_microbatches(tmp_path) -> None:
    run = {k: [[[4 * k, 4 * k + 1], [4 * k + 2]], [[4 * k + 3], [100 + k]]] for k in range(5)}
    trace, summary = _write_run(tmp_path, run)
    steps = read_traced_steps(trace, summary, skip=3)
    assert [s for s, _ in steps] == [4.0, 5.0]
    assert [order for _, order in steps] == [run[3], run[4]]
    summary.write_text(json.dumps({"steps": [{"step": 3, "step_s": 4.0}]}))
    with pytest.raises(ValueError, match="no step 4"):
        read_traced_steps(trace, summary, skip=3)


def test_replayed_colocated_step_is_no_slower_than_the_local_encoder_on_skewed_ranks() -> None:
    model = reference_model("llava-ov-0.5b-h100")
    shapes = _shapes(12)
    videos = [i for i, s in enumerate(shapes) if s.video_frames]
    rest = [i for i in range(12) if i not in videos]
    order = [[videos[:2], videos[2:4]], [rest[:2], rest[2:4]]]  # rank 0 drew the videos
    layout = Layout(
        Segment(1, 1, 2), Segment(1, 1, 2), 2, ((model.encoder_layers, 1, model.llm_layers),), colocated=True
    )
    cluster = Cluster(gpus=2, gpus_per_node=2)
    colocated = colocated_step(model, cluster, layout, shapes, order).sim.step_time
    # the encoder spread over both ranks beats each rank encoding its own samples
    assert colocated < local_compute_seconds(model, shapes, order)
