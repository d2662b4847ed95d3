"""Check the 1F1B simulator against real runs: `make validate-simulator`.

1. Profiles the tiny model alone (the CostModel; reused if present).
2. Profiles the engine: a short 2-rank run with the *stock* sampler and DeepSpeed's default
   stage split, telemetry on; fits an EngineProfile from it (in-engine compute multipliers,
   microbatch load, the step's tail, the cost of one blocking exchange; see
   ``dflop_ds.profile.engine``).
3. Runs the validated job: 2 ranks, the DFLOP sampler, the profiled cost model and its
   cost-balanced stage split (other batches, microbatch sizes and split than step 2).
4. Simulates every timed step of step 3 from the cost model's predictions of its microbatches,
   with the engine profile and without it, and compares with the measured step times.

Nothing of step 3 feeds the prediction. Last line: `simulator step_time error=<x>
cost_model_only=<y>` (mean relative error over the timed steps).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import profiled_cost_model  # noqa: E402
from dflop_ds.config import DFLOPConfig, set_settings  # noqa: E402
from dflop_ds.data import read_dataset  # noqa: E402
from dflop_ds.launch import run_deepspeed  # noqa: E402
from dflop_ds.plan.evaluate import forward_fraction  # noqa: E402
from dflop_ds.plan.simulator import simulate_1f1b  # noqa: E402
from dflop_ds.plan.stages import cost_balanced_bounds, stage_shares  # noqa: E402
from dflop_ds.profile.engine import EngineProfile, engine_profile_from_run, read_engine_steps  # noqa: E402
from dflop_ds.shapes import TINY_POLICY  # noqa: E402

WARMUP = 3


def train(config: dict, block: dict, telemetry: Path, out: Path, name: str) -> None:
    """One 2-rank run of examples/train.py with ``block`` as its "dflop" settings."""
    path = out / f"{name}_config.json"
    path.write_text(json.dumps({**config, "dflop": block}))
    telemetry.unlink(missing_ok=True)
    run_deepspeed(ROOT / "examples" / "train.py", ["--deepspeed_config", path, "--telemetry", telemetry],
                  cwd=ROOT, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cost-model", default=str(ROOT / "out" / "costmodel_tiny.json"),
                        help="profiled CostModel JSON (profiled now if missing)")
    parser.add_argument("--config", default=str(ROOT / "ds_configs" / "tiny_mllm_pp2.json"))
    parser.add_argument("--profile-steps", type=int, default=15, help="steps of the engine-profiling run")
    parser.add_argument("--steps", type=int, default=27, help="steps of the validated run (3 warm-up)")
    parser.add_argument("--out", default=str(ROOT / "out"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cost_model = profiled_cost_model(args.cost_model, reuse=True)
    config = json.loads(Path(args.config).read_text())
    block = config.pop("dflop")
    settings = DFLOPConfig.from_dict(block, source=args.config)
    shapes = read_dataset(ROOT / settings.data, TINY_POLICY)

    print("profiling the engine: a stock-sampler run with DeepSpeed's default split ...", flush=True)
    engine_run = out / "engine_profile_run.jsonl"
    train(config, set_settings(copy.deepcopy(block), sampler="stock", steps=args.profile_steps, warmup_steps=WARMUP),
          engine_run, out, "engine_profile")
    engine = engine_profile_from_run(engine_run, shapes, cost_model, skip_steps=WARMUP)
    engine.save(out / "engine_tiny.json")

    bounds = cost_balanced_bounds(cost_model, shapes, settings.pipeline_stages)
    validated = out / "validate_telemetry.jsonl"
    train(config, set_settings(copy.deepcopy(block), sampler="dflop", cost_model=str(Path(args.cost_model).resolve()),
                               stage_bounds=bounds, steps=args.steps, warmup_steps=WARMUP), validated, out, "validate")
    steps, run_bounds = read_engine_steps(validated, shapes, cost_model, skip_steps=WARMUP)
    shares = stage_shares(run_bounds, cost_model)
    report(engine, steps, shares, forward_fraction(cost_model), run_bounds)
    return 0


def report(engine: EngineProfile, steps, shares: np.ndarray, ff: float, bounds: list[int]) -> None:
    """Print the per-step comparison and the last line."""
    measured = np.array([step.step_s for step in steps])
    profiled = np.array([engine.simulate(step.costs, shares).step_time for step in steps])
    alone = np.array([simulate_1f1b(ff * (step.costs @ shares.T), (1 - ff) * (step.costs @ shares.T)).step_time
                      for step in steps])
    print(f"\nengine profile (stock run, split {engine.meta['stage_bounds']}): compute x{np.round(engine.compute_scale, 3)} "
          f"[encoder, llm], forward share {engine.forward_fraction:.3f}, load {np.round(np.multiply(engine.load_s, 1e3), 1)} "
          f"ms/microbatch, tail {np.round(np.multiply(engine.tail_s, 1e3), 1)} ms, exchange {engine.exchange_s * 1e3:.2f} ms")
    print(f"validated run: DFLOP sampler, split {bounds}, {len(steps)} timed steps")
    print(f"{'step':>4s} {'measured s':>11s} {'simulated s':>12s} {'error':>8s} {'cost model only s':>18s} {'error':>8s}")
    for k in range(len(steps)):
        print(f"{k + WARMUP:4d} {measured[k]:11.3f} {profiled[k]:12.3f} {profiled[k] / measured[k] - 1:+8.1%} "
              f"{alone[k]:18.3f} {alone[k] / measured[k] - 1:+8.1%}")
    error = float(np.mean(np.abs(profiled / measured - 1)))
    alone_error = float(np.mean(np.abs(alone / measured - 1)))
    print(f"mean step: measured {measured.mean():.3f} s, simulated {profiled.mean():.3f} s, cost model only "
          f"{alone.mean():.3f} s; worst step error {np.max(np.abs(profiled / measured - 1)):.3f}")
    print(f"simulator step_time error={error:.3f} cost_model_only={alone_error:.3f}")


if __name__ == "__main__":
    sys.exit(main())
