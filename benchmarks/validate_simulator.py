"""Check the 1F1B simulator against a real run: `make validate-simulator`.

Trains the tiny MLLM on 2 ranks (2 pipeline stages, the DFLOP sampler, the profiled cost model,
its cost-balanced stage split) and simulates every timed step two ways:

* from the cost model alone (per-microbatch encoder/LLM predictions split over the stages);
* calibrated: the first half of the timed steps measures how much slower each stage computes in
  training than in the isolated profile (two ranks share the machine) and the step time the
  simulation leaves out (DeepSpeed's per-instruction work, p2p, optimizer); the second half,
  never used for calibration, is predicted with both.

Last line: `simulator step_time error raw=<x> calibrated=<y>` (mean relative error over the
held-out half).
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


def microbatch_costs(cost_model, shapes, microbatches) -> np.ndarray:
    """``(m, 2)`` predicted [encoder, llm] seconds of one rank's microbatches (dataset indices)."""
    return np.array([cost_model.predict_microbatch([shapes[i] for i in mb]) for mb in microbatches])


def simulate(stage_seconds: np.ndarray, forward_share: float) -> float:
    """1F1B step time of ``(m, stages)`` forward+backward seconds."""
    return simulate_stage_times(forward_share * stage_seconds, (1 - forward_share) * stage_seconds).step_time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cost-model", default=str(ROOT / "out" / "costmodel_tiny.json"),
                        help="profiled CostModel JSON (profiled now if missing)")
    parser.add_argument("--config", default=str(ROOT / "ds_configs" / "tiny_mllm_pp2.json"))
    parser.add_argument("--steps", type=int, default=27, help="steps to train (3 warm-up, then half/half)")
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

    steps = {r["step"]: r for r in json.loads(summary.read_text())["steps"]}
    shares = stage_shares(bounds, cost_model.encoder_layers, cost_model.llm_layers)
    timed = [line for line in map(json.loads, trace.read_text().splitlines())
             if line["dp_rank"] == 0 and line["step"] >= block["warmup_steps"]]
    predicted = [stage_times(microbatch_costs(cost_model, shapes, line["microbatches"]), shares) for line in timed]
    measured = np.array([steps[line["step"]]["step_s"] for line in timed])
    half = len(timed) // 2
    compute = np.array([steps[line["step"]]["telemetry"]["stage_compute_s"] for line in timed[:half]])
    scale = compute.sum(axis=0) / np.sum([p.sum(axis=0) for p in predicted[:half]], axis=0)
    ff = forward_fraction(cost_model)
    raw = np.array([simulate(p, ff) for p in predicted])
    scaled = np.array([simulate(p * scale, ff) for p in predicted])
    overhead = float(np.median(measured[:half] - scaled[:half]))
    calibrated = scaled + overhead

    print(f"\nstage bounds {bounds}; {len(timed)} timed steps (2 ranks, 2 stages); calibrated on the first {half}: "
          f"stage compute x{np.round(scale, 3).tolist()} of the profile, +{overhead * 1e3:.0f} ms per step")
    print(f"{'step':>4s} {'measured s':>11s} {'raw sim s':>10s} {'error':>8s} {'calibrated s':>13s} {'error':>8s}")
    for k, line in enumerate(timed):
        tag = "" if k >= half else "  (calibration)"
        print(f"{line['step']:4d} {measured[k]:11.3f} {raw[k]:10.3f} {raw[k] / measured[k] - 1:+8.1%} "
              f"{calibrated[k]:13.3f} {calibrated[k] / measured[k] - 1:+8.1%}{tag}")
    held = slice(half, None)
    raw_error = float(np.mean(np.abs(raw[held] / measured[held] - 1)))
    calibrated_error = float(np.mean(np.abs(calibrated[held] / measured[held] - 1)))
    print(f"simulator step_time error raw={raw_error:.3f} calibrated={calibrated_error:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
