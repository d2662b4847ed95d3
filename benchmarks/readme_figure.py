"""`make readme-figure`: the README's picture, a Gantt chart of one global batch of the demo's
set-up (the tiny MLLM on a 2-stage pipeline with DeepSpeed's uniform layer split, 8 microbatches,
a global batch of 32 drawn from ``examples/data/mixture.jsonl``) cut by the stock sampler (padded,
fixed sample counts) and by DFLOP (packed, balanced), on the same layers and the same batch.

The step is PREDICTED by the 1F1B simulator from the tiny model's cost model profiled on this
machine (``out/costmodel_tiny.json``, profiled first when missing, as ``make bench-e2e`` does);
``make bench-e2e`` measures the real runs and ``make validate-simulator`` the simulator's error.
Writes ``docs/figures/stock_vs_dflop.png`` and prints each panel's predicted step.

Run: ``.venv/bin/python benchmarks/readme_figure.py`` from the repository root.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import profiled_cost_model  # noqa: E402
from dflop_ds.data import read_manifest  # noqa: E402
from dflop_ds.models import TinyMLLMConfig, tiny_mllm_layers  # noqa: E402
from dflop_ds.pipe.stage_bounds import uniform_bounds  # noqa: E402
from dflop_ds.plan.cluster import Cluster  # noqa: E402
from dflop_ds.plan.gantt import plot_gantt  # noqa: E402
from dflop_ds.plan.layout import Layout, Segment, stages_from_bounds  # noqa: E402
from dflop_ds.plan.planner import simulate_layout  # noqa: E402
from dflop_ds.plan.projection import PackedView  # noqa: E402
from dflop_ds.shapes import TINY_POLICY  # noqa: E402


def demo_stages() -> tuple:
    """DeepSpeed's uniform split of the tiny MLLM's pipeline layers over 2 stages
    (``ds_configs/tiny_mllm_pp2.json``), as ``(encoder, projector, llm)`` layers per stage."""
    encoder, _, llm = tiny_mllm_layers(TinyMLLMConfig(), as_specs=False)  # one projector layer
    return stages_from_bounds(uniform_bounds(len(encoder) + 1 + len(llm), 2), len(encoder), 1, len(llm))


#: (panel title, registered splitter, packed microbatches)
METHODS = (("stock sampler (padded)", "stock", False), ("DFLOP (packed, balanced)", "dflop", True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT / "examples/data/mixture.jsonl"))
    parser.add_argument("--cost-model", default=str(ROOT / "out/costmodel_tiny.json"))
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--png", default=str(ROOT / "docs/figures/stock_vs_dflop.png"))
    args = parser.parse_args()

    model = profiled_cost_model(args.cost_model)
    shapes = list(read_manifest(args.data, TINY_POLICY))
    cluster = Cluster(gpus=2, gpus_per_node=2, gpu_memory_bytes=8e9)
    panels = []
    stages = demo_stages()
    for title, splitter, packed in METHODS:
        layout = Layout(Segment(1, 1, 1), Segment(1, 1, 1), args.microbatches, stages, splitter=splitter)
        view = PackedView(model) if packed else model
        (evaluation,) = simulate_layout(view, cluster, layout, shapes, args.global_batch, seed=args.seed)
        sim = evaluation.sim
        print(f"{title:<26} predicted step {sim.step_time:.3f} s, bubble {sim.bubble_fraction:.1%}")
        panels.append((title, evaluation.sim))
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    plot_gantt(panels, args.png)
    stock, dflop = (sim.step_time for _, sim in panels)
    print(f"wrote {args.png} (predicted by the 1F1B simulator from {args.cost_model})")
    print(f"readme-figure predicted_speedup={stock / dflop:.2f} global_batch={args.global_batch}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
