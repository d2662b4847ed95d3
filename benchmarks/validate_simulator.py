"""Check the 1F1B simulator against a real run: `make validate-simulator`.

Trains the tiny MLLM for a few steps on 2 ranks (2 pipeline stages, the DFLOP sampler, the
profiled cost model, its cost-balanced stage split), then simulates every timed step from the
cost model alone (per-microbatch encoder/LLM predictions, split over the stages) and compares
the simulated step time with the measured one. Last line:
`simulator step_time error mean=<x> median=<y> total=<z>` (relative errors).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import profiled_cost_model  # noqa: E402
from dflop_ds.data import read_dataset  # noqa: E402
from dflop_ds.launch import run_deepspeed  # noqa: E402
from dflop_ds.plan.evaluate import forward_fraction  # noqa: E402
from dflop_ds.plan.simulator import simulate_stage_times  # noqa: E402
from dflop_ds.plan.stages import cost_balanced_bounds, stage_shares, stage_times  # noqa: E402
from dflop_ds.shapes import TINY_POLICY  # noqa: E402


def simulate_step(cost_model, shapes, microbatches, shares) -> float:
    """Predicted step time of one rank's microbatches (lists of dataset indices)."""
    costs = np.array([cost_model.predict_microbatch([shapes[i] for i in mb]) for mb in microbatches])
    per_stage = stage_times(costs, shares)
    ff = forward_fraction(cost_model)
    return simulate_stage_times(ff * per_stage, (1 - ff) * per_stage).step_time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cost-model", default=str(ROOT / "out" / "costmodel_tiny.json"),
                        help="profiled CostModel JSON (profiled now if missing)")
    parser.add_argument("--config", default=str(ROOT / "ds_configs" / "tiny_mllm_pp2.json"))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", default=str(ROOT / "out"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cost_model = profiled_cost_model(args.cost_model, reuse=True)

    config = json.loads(Path(args.config).read_text())
    block = config["dflop"]
    shapes = read_dataset(ROOT / block.get("data", "examples/data/mixture.jsonl"), TINY_POLICY)
    bounds = cost_balanced_bounds(cost_model, shapes, block.get("pipeline_stages", 2))
    block.update(sampler="dflop", cost_model=str(Path(args.cost_model).resolve()), stage_bounds=bounds,
                 steps=args.steps, warmup_steps=min(3, args.steps - 1))
    run_config, trace, summary = out / "validate_config.json", out / "validate_trace.jsonl", out / "validate.json"
    run_config.write_text(json.dumps(config))
    trace.unlink(missing_ok=True)
    run_deepspeed(ROOT / "examples" / "train.py",
                  ["--deepspeed_config", run_config, "--trace", trace, "--summary", summary], cwd=ROOT, check=True)

    measured = {r["step"]: r["step_s"] for r in json.loads(summary.read_text())["steps"]}
    shares = stage_shares(bounds, cost_model.encoder_layers, cost_model.llm_layers)
    rows = []
    for line in map(json.loads, trace.read_text().splitlines()):
        if line["dp_rank"] != 0 or line["step"] < block["warmup_steps"]:
            continue
        rows.append((line["step"], measured[line["step"]], simulate_step(cost_model, shapes, line["microbatches"], shares)))
    print(f"\nstage bounds {bounds}; {len(rows)} timed steps (2 ranks, 2 stages, CPU)")
    print(f"{'step':>4s} {'measured s':>11s} {'simulated s':>12s} {'error':>8s}")
    errors = []
    for step, real, sim in rows:
        errors.append((sim - real) / real)
        print(f"{step:4d} {real:11.3f} {sim:12.3f} {errors[-1]:+8.1%}")
    total = (sum(r[2] for r in rows) - sum(r[1] for r in rows)) / sum(r[1] for r in rows)
    abs_errors = np.abs(errors)
    print(f"simulator step_time error mean={abs_errors.mean():.3f} median={np.median(abs_errors):.3f} "
          f"total={total:+.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
