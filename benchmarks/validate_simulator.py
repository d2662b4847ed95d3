"""Check the 1F1B simulator against real runs: `make validate-simulator`.

1. Profiles the tiny model alone (the FittedCostModel; reused if present).
2. Profiles the engine: a short 2-rank run with the *stock* sampler and DeepSpeed's default
   stage split, telemetry on; fits an EngineProfile from it (in-engine compute multipliers,
   microbatch load, the step's tail, the cost of one blocking exchange; see
   ``dflop_ds.plan.engine_profile``).
3. Runs the validated job: 2 ranks, the DFLOP sampler, the profiled cost model and its
   cost-balanced stage split (other batches, microbatch sizes and split than step 2).
4. Simulates every timed step of step 3 from the cost model's predictions of its microbatches,
   with the engine profile and without it, and compares with the measured step times.
5. The colocated case: profiles the plain engine (2 ranks, ZeRO-2, no pipeline, the stock
   sampler, the encoder local): what a step costs beyond its compute (load, ZeRO's reductions,
   the optimizer), the mean of measured minus simulated. Then runs 2 ranks, ZeRO-2, the DFLOP
   sampler and ``"encoder": "colocated"`` (the encoder's work dispatched by cost over both
   ranks, features exchanged); every timed step is replayed by the planner's colocated step
   simulation (``dflop_ds.plan.families.colocated.colocated_step``) on the microbatches the run
   trained, with the engine terms (step 2's compute multipliers, forward share and exchange
   cost, one exchange per micro-step and direction; the plain engine's overhead) and without.

6. The ZeRO table (:func:`validate_zero`): the encoder-heavy tiny HF LLaVA on 2 ranks under
   ZeRO-1, ZeRO-2 and ZeRO-3 with buckets below a layer's size and under ZeRO-2 with DeepSpeed's
   default buckets (one bucket swallows the tiny model), every split of
   :data:`benchmarks.zero_worker.SPLITS` in interleaved rounds. Each config's ``twin`` splits
   (the same microbatches on both ranks, where every sync model predicts the same step) give the
   measured per-microbatch (encoder, LLM) seconds and the engine's time beyond them; the other
   splits (heavy/light microbatches in opposite orders, encoder- and LLM-heavy microbatches
   crossed between ranks) are predicted by :func:`dflop_ds.sync.step_cost` under every sync model
   and compared with their measured median step.

Nothing of steps 3 and 5 feeds the predictions. Last line: `simulator step_time error=<x>
cost_model_only=<y> colocated_error=<a> colocated_cost_model_only=<b> zero_error_median=<f>`
(mean relative errors over the timed steps of the pipelined and the colocated runs; f: the median
over the sync models of the median step-time error of the splits their configs ran).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from deepspeed.accelerator import get_accelerator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import profiled_cost_model, run_worker  # noqa: E402
from benchmarks.zero_worker import SPLITS  # noqa: E402
from dflop_ds.config import DFLOPConfig, get_setting, set_settings  # noqa: E402
from dflop_ds.cost import EngineScaled, PlannerCostModel  # noqa: E402
from dflop_ds.data import read_dataset  # noqa: E402
from dflop_ds.jsonio import read_json_object  # noqa: E402
from dflop_ds.launch import run_deepspeed  # noqa: E402
from dflop_ds.plan.calibration import save_calibration  # noqa: E402
from dflop_ds.plan.cluster import Cluster  # noqa: E402
from dflop_ds.plan.engine_profile import EngineProfile, engine_profile_from_run, read_engine_steps  # noqa: E402
from dflop_ds.plan.evaluate import forward_fraction  # noqa: E402
from dflop_ds.plan.families.colocated import colocated_step  # noqa: E402
from dflop_ds.plan.layout import Layout, Segment  # noqa: E402
from dflop_ds.plan.simulator import simulate_1f1b  # noqa: E402
from dflop_ds.plan.stages import cost_balanced_bounds, stage_shares  # noqa: E402
from dflop_ds.shapes import TINY_POLICY  # noqa: E402
from dflop_ds.sync import SyncModel, step_cost, sync_model_of  # noqa: E402

WARMUP = 3
#: the ZeRO table's engines: label -> DeepSpeed config (its zero_optimization block is used)
ZERO_CONFIGS = {
    "zero1": "ds_configs/zero1_small_buckets.json",
    "zero2_default": "ds_configs/hf_trainer_zero2.json",
    "zero2": "ds_configs/zero2_small_buckets.json",
    "zero3": "ds_configs/zero3_small_buckets.json",
}
#: the sync models the ZeRO table scores (pipelines are the simulator's, validated above)
ZERO_SYNC_MODELS = (SyncModel.BOUNDARY, SyncModel.MICROSTEP, SyncModel.MODULE)


def train(config: dict, block: dict, out: Path, name: str, outputs: dict[str, Path]) -> None:
    """One 2-rank run of examples/train.py with ``block`` as its "dflop" settings; ``outputs``
    maps options (``--telemetry``, ``--trace``, ``--summary``) to the files they write (emptied first)."""
    path = out / f"{name}_config.json"
    path.write_text(json.dumps({**config, "dflop": block}))
    args: list = ["--deepspeed_config", path]
    for option, file in outputs.items():
        file.unlink(missing_ok=True)
        args += [option, file]
    run_deepspeed(ROOT / "examples" / "train.py", args, cwd=ROOT, check=True)


def read_traced_steps(trace: Path, summary: Path, skip: int) -> list[tuple[float, list]]:
    """``(measured step seconds, microbatches per rank)`` of every step after ``skip`` warm-up steps."""
    ranks: dict[int, dict[int, list]] = {}
    for line in trace.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            ranks.setdefault(int(record["step"]), {})[int(record["dp_rank"])] = record["microbatches"]
    measured = {int(r["step"]): float(r["step_s"]) for r in json.loads(summary.read_text())["steps"]}
    steps = []
    for step in sorted(ranks):
        if step >= skip:
            if step not in measured:
                raise ValueError(f"{summary}: no step {step}, which {trace} traced")
            steps.append((measured[step], [ranks[step][r] for r in sorted(ranks[step])]))
    if not steps:
        raise ValueError(f"{trace}: no traced step after the first {skip}")
    return steps


def plain_run(config: dict, block: dict, out: Path, name: str, steps: int) -> list[tuple[float, list]]:
    """A 2-rank plain-engine run of ``steps`` steps; its timed steps (see :func:`read_traced_steps`)."""
    trace, summary = out / f"{name}_trace.jsonl", out / f"{name}_summary.json"
    train(
        config,
        set_settings(copy.deepcopy(block), steps=steps, warmup_steps=WARMUP),
        out,
        name,
        {"--trace": trace, "--summary": summary},
    )
    return read_traced_steps(trace, summary, WARMUP)


def local_compute_seconds(model: Any, shapes, order: list) -> float:
    """Compute seconds of a plain-engine step with the encoder on each sample's own rank: every
    micro-step waits for its slowest rank (ZeRO-2 reduces gradients in each backward)."""
    n_mb = len(order[0])
    return float(
        sum(
            max(float(np.sum(model.predict_microbatch([shapes[i] for i in rank[j]]))) for rank in order)
            for j in range(n_mb)
        )
    )


def validate_colocated(
    args: argparse.Namespace, cost_model: PlannerCostModel, engine: EngineProfile, out: Path
) -> tuple[float, float]:
    """Step 5 of the module docstring; returns the mean relative errors (engine terms, cost model only)."""
    config = read_json_object(args.colocated_config)
    block = config.pop("dflop")
    shapes = read_dataset(ROOT / (get_setting(block, "data") or "examples/data/mixture.jsonl"), TINY_POLICY)
    scaled = EngineScaled(cost_model, engine.compute_scale, engine.forward_fraction)
    print("\nprofiling the plain engine: ZeRO-2, 2 ranks, stock sampler, local encoder ...", flush=True)
    profile = plain_run(
        config,
        set_settings(copy.deepcopy(block), sampler="stock", encoder="local"),
        out,
        "plain_profile",
        args.profile_steps,
    )
    overhead = float(np.mean([s - local_compute_seconds(scaled, shapes, order) for s, order in profile]))
    print(f"plain engine: {overhead:.3f} s per step beyond the compute ({len(profile)} steps)", flush=True)
    print("the colocated case: ZeRO-2, 2 ranks, DFLOP sampler, encoder dispatched by cost ...", flush=True)
    steps = plain_run(
        config,
        set_settings(
            copy.deepcopy(block), sampler="dflop", encoder="colocated", cost_model=str(Path(args.cost_model).resolve())
        ),
        out,
        "validate_colocated",
        args.colocated_steps,
    )
    dp, n_mb = len(steps[0][1]), len(steps[0][1][0])
    layout = Layout(
        Segment(1, 1, dp),
        Segment(1, 1, dp),
        n_mb,
        ((cost_model.encoder_layers, 1, cost_model.llm_layers),),
        colocated=True,
    )
    cluster = Cluster(gpus=dp, gpus_per_node=dp, gpu_memory_bytes=1e15, memory_reserve_bytes=0.0)
    engine_terms = overhead + 2 * n_mb * engine.exchange_s  # one all-to-all per micro-step and direction
    measured = np.array([s for s, _ in steps])
    profiled = np.array(
        [colocated_step(scaled, cluster, layout, shapes, order).sim.step_time + engine_terms for _, order in steps]
    )
    alone = np.array([colocated_step(cost_model, cluster, layout, shapes, order).sim.step_time for _, order in steps])
    return compare("colocated run: DFLOP sampler, encoder dispatched over 2 ranks, ZeRO-2", measured, profiled, alone)


def kind_times(rows: list[dict]) -> tuple[dict[str, np.ndarray], float]:
    """From one config's timed ``twin`` rows: each microbatch kind's median (encoder, LLM) seconds
    over every rank and round, and the median engine time beyond the slowest rank's microbatches."""
    samples: dict[str, list] = {}
    beyond = []
    for row in rows:
        for kinds, times in zip(row["kinds"], row["times"]):
            for kind, (encoder, total) in zip(kinds, times):
                samples.setdefault(kind, []).append((encoder, total - encoder))
        beyond.append(row["step_s"] - max(sum(total for _, total in times) for times in row["times"]))
    return {kind: np.median(np.array(values), axis=0) for kind, values in samples.items()}, float(np.median(beyond))


def zero_predictions(rows: list[dict], dp: int) -> dict[str, dict[str, float]]:
    """Per split of one config: its measured median step and the step every sync model predicts
    (:func:`step_cost` of the twins' per-kind times, plus the engine time beyond them)."""
    timed = [row for row in rows if not row["warmup"]]
    times, beyond = kind_times([row for row in timed if row["split"].startswith("twin")])
    table = {}
    for split, ranks in SPLITS.items():
        grid = np.array([[times[kind] for kind in ranks[r % 2]] for r in range(dp)])
        measured = float(np.median([row["step_s"] for row in timed if row["split"] == split]))
        table[split] = {"measured": measured, **{str(m): step_cost(grid, m) + beyond for m in ZERO_SYNC_MODELS}}
    return table


def validate_zero(args: argparse.Namespace, out: Path) -> float:
    """Step 6 of the module docstring: prints the ZeRO table; returns the median over the sync
    models of the median error of the non-twin splits their configs ran."""
    from dflop_ds.testing.hf_tiny import build_encoder_heavy_llava

    model = out / "zero_model"
    if not (model / "config.json").exists():
        build_encoder_heavy_llava(model)
    raw = out / "zero_rows.json"
    configs = ",".join(f"{label}={ROOT / path}" for label, path in ZERO_CONFIGS.items())
    print("\nthe ZeRO table: encoder-heavy tiny HF LLaVA, 2 ranks, 2 microbatches a step ...", flush=True)
    written = run_worker(
        "zero_worker.py",
        ["--model", str(model), "--configs", configs, "--rounds", str(args.zero_rounds), "--out", str(raw)],
        raw,
    )
    errors: dict[SyncModel, list[float]] = {}
    print(f"\nZeRO table ({args.zero_rounds} timed rounds; step seconds, medians; predicted = step_cost of the twins'")
    print("per-microbatch (encoder, LLM) seconds + the engine time beyond them; * marks the config's sync model)")
    header = "".join(f"{str(m):>11s}" for m in ZERO_SYNC_MODELS)
    print(
        f"{'config':14s} {'sync model':11s} {'split':17s} {'measured':>9s}{header} "
        f"{'error':>8s} {'effect':>7s} {'pred.':>7s}"
    )
    for label, path in ZERO_CONFIGS.items():
        sync = sync_model_of(read_json_object(ROOT / path), largest_layer_elements=written["largest_layer"])
        table = zero_predictions([row for row in written["rows"] if row["config"] == label], written["dp"])
        for split, entry in table.items():
            twin = table["twin_order" if split.endswith("order") else "twin_halves"]
            error = abs(entry[str(sync)] / entry["measured"] - 1)
            if not split.startswith("twin"):
                errors.setdefault(sync, []).append(error)
            predicted = "".join(f"{entry[str(m)]:>10.3f}{'*' if m is sync else ' '}" for m in ZERO_SYNC_MODELS)
            print(
                f"{label:14s} {str(sync):11s} {split:17s} {entry['measured']:9.3f}{predicted} {error:8.1%} "
                f"{entry['measured'] / twin['measured']:7.3f} {entry[str(sync)] / twin[str(sync)]:7.3f}"
            )
    medians = {sync: float(np.median(values)) for sync, values in errors.items()}
    print("effect: the split's measured step over its twin's; pred.: the same ratio as its sync model predicts")
    print("median step-time error of the non-twin splits: " + ", ".join(f"{m} {e:.1%}" for m, e in medians.items()))
    return float(np.median(list(medians.values())))


def compare(title: str, measured: np.ndarray, profiled: np.ndarray, alone: np.ndarray) -> tuple[float, float]:
    """Print the per-step table of a run; the mean relative errors (with the engine profile, cost model only)."""
    print(f"{title}, {len(measured)} timed steps")
    print(
        f"{'step':>4s} {'measured s':>11s} {'simulated s':>12s} {'error':>8s} {'cost model only s':>18s} {'error':>8s}"
    )
    for k in range(len(measured)):
        print(
            f"{k + WARMUP:4d} {measured[k]:11.3f} {profiled[k]:12.3f} {profiled[k] / measured[k] - 1:+8.1%} "
            f"{alone[k]:18.3f} {alone[k] / measured[k] - 1:+8.1%}"
        )
    error = float(np.mean(np.abs(profiled / measured - 1)))
    alone_error = float(np.mean(np.abs(alone / measured - 1)))
    print(
        f"mean step: measured {measured.mean():.3f} s, simulated {profiled.mean():.3f} s, cost model only "
        f"{alone.mean():.3f} s; worst step error {np.max(np.abs(profiled / measured - 1)):.3f}"
    )
    return error, alone_error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cost-model",
        default=str(ROOT / "out" / "costmodel_tiny.json"),
        help="profiled FittedCostModel JSON (profiled now if missing)",
    )
    parser.add_argument("--config", default=str(ROOT / "ds_configs" / "tiny_mllm_pp2.json"))
    parser.add_argument("--profile-steps", type=int, default=15, help="steps of the engine-profiling run")
    parser.add_argument("--steps", type=int, default=27, help="steps of the validated run (3 warm-up)")
    parser.add_argument("--colocated-config", default=str(ROOT / "ds_configs" / "tiny_zero2.json"))
    parser.add_argument("--colocated-steps", type=int, default=20, help="steps of the colocated run (3 warm-up)")
    parser.add_argument("--zero-rounds", type=int, default=10, help="timed rounds of the ZeRO table")
    parser.add_argument("--zero-only", action="store_true", help="run only the ZeRO table")
    parser.add_argument("--out", default=str(ROOT / "out"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.zero_only:
        print(f"zero_error_median={validate_zero(args, out):.3f}")
        return 0
    cost_model = profiled_cost_model(args.cost_model, reuse=True)
    config = read_json_object(args.config)
    block = config.pop("dflop")
    settings = DFLOPConfig.from_dict(block, source=args.config)
    shapes = read_dataset(ROOT / settings.data.path, TINY_POLICY)

    print("profiling the engine: a stock-sampler run with DeepSpeed's default split ...", flush=True)
    engine_run = out / "engine_profile_run.jsonl"
    train(
        config,
        set_settings(copy.deepcopy(block), sampler="stock", steps=args.profile_steps, warmup_steps=WARMUP),
        out,
        "engine_profile",
        {"--telemetry": engine_run},
    )
    engine = engine_profile_from_run(engine_run, shapes, cost_model, skip_steps=WARMUP)
    engine.save(out / "engine_tiny.json")

    bounds = cost_balanced_bounds(cost_model, shapes, settings.plan.pipeline_stages)
    validated = out / "validate_telemetry.jsonl"
    train(
        config,
        set_settings(
            copy.deepcopy(block),
            sampler="dflop",
            cost_model=str(Path(args.cost_model).resolve()),
            stage_bounds=bounds,
            steps=args.steps,
            warmup_steps=WARMUP,
        ),
        out,
        "validate",
        {"--telemetry": validated},
    )
    steps, run_bounds = read_engine_steps(validated, shapes, cost_model, skip_steps=WARMUP)
    shares = stage_shares(run_bounds, cost_model)
    error, alone_error = report(engine, steps, shares, forward_fraction(cost_model), run_bounds)
    colocated_error, colocated_alone = validate_colocated(args, cost_model, engine, out)
    zero_error = validate_zero(args, out)
    figures = {
        "error": error,
        "cost_model_only": alone_error,
        "colocated_error": colocated_error,
        "colocated_cost_model_only": colocated_alone,
    }
    device = get_accelerator().device_name()
    save_calibration(  # what `dflop-ds project` prints beside its predictions
        out / "simulator_calibration.json",
        figures,
        measured=time.strftime("%d %b %Y %H:%M UTC", time.gmtime()),
        machine=f"2 {'GPU' if device == 'cuda' else device.upper()} ranks, tiny model",
    )
    print(
        f"simulator step_time error={error:.3f} cost_model_only={alone_error:.3f} "
        f"colocated_error={colocated_error:.3f} colocated_cost_model_only={colocated_alone:.3f} "
        f"zero_error_median={zero_error:.3f}"
    )
    return 0


def report(engine: EngineProfile, steps, shares: np.ndarray, ff: float, bounds: list[int]) -> tuple[float, float]:
    """Print the pipelined run's per-step comparison; its mean relative errors (engine profile, cost model only)."""
    measured = np.array([step.step_s for step in steps])
    profiled = np.array([engine.simulate(step.costs, shares).step_time for step in steps])
    alone = np.array(
        [simulate_1f1b(ff * (step.costs @ shares.T), (1 - ff) * (step.costs @ shares.T)).step_time for step in steps]
    )
    print(
        f"\nengine profile (stock run, split {engine.meta['stage_bounds']}): "
        f"compute x{np.round(engine.compute_scale, 3)} [encoder, llm], forward share {engine.forward_fraction:.3f}, "
        f"load {np.round(np.multiply(engine.load_s, 1e3), 1)} ms/microbatch, "
        f"tail {np.round(np.multiply(engine.tail_s, 1e3), 1)} ms, exchange {engine.exchange_s * 1e3:.2f} ms"
    )
    return compare(f"validated run: DFLOP sampler, split {bounds}", measured, profiled, alone)


if __name__ == "__main__":
    sys.exit(main())
