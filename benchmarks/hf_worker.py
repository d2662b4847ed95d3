"""One rank of `make bench-hf` (launched by bench_hf.py under `deepspeed`).

One engine (the pipeline engine with 2 stages, or the plain engine with ZeRO-2) over a
HuggingFace directory of any registered family, built by the library's training pieces (``hf_source``,
``build_engine``). Every method's sampler shares the seed, so they cut the same global batches;
every round trains the same batch with each method, the order rotating every round, and rank 0
writes each step's time and token counts. The methods run as their users run them
(:mod:`benchmarks.e2e_methods`): stock and LLaVA pad their microbatches (``source.collate``),
verl and dflop-ds pack them (``source.packed_collate``) and schedule on the packed cost
(:class:`~dflop_ds.cost.PackedCost`), and ``stock_packed`` is stock's split packed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import add_worker_options, round_row, timed_train_step, worker_ds_config  # noqa: E402
from benchmarks.e2e_methods import ONE_ENGINE_METHODS, PACKED_METHODS, SPLITTERS, method_cost_model  # noqa: E402
from dflop_ds.cost import load_cost_model  # noqa: E402
from dflop_ds.models.hf.source import hf_source  # noqa: E402
from dflop_ds.rank_lifecycle import finish_rank  # noqa: E402
from dflop_ds.schedule.index import ScheduledIndex  # noqa: E402
from dflop_ds.schedule.sampler import SamplerSettings, make_sampler  # noqa: E402
from dflop_ds.sync import sync_model_of  # noqa: E402
from dflop_ds.telemetry.record import batch_tokens  # noqa: E402
from dflop_ds.train import build_engine  # noqa: E402
from dflop_ds.train.loop import stage_bounds, start_distributed  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=("pp2", "zero2"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--images", required=True)
    parser.add_argument("--videos", help="folder the records' video paths are relative to")
    parser.add_argument(
        "--methods", default=",".join(ONE_ENGINE_METHODS), help=f"comma-separated, of {ONE_ENGINE_METHODS}"
    )
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (DeepSpeed's bf16 section)")
    add_worker_options(parser, global_batch=16, gas=4, rounds=10)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(ONE_ENGINE_METHODS))
    if unknown:
        raise ValueError(f"unknown methods {unknown}: choose from {ONE_ENGINE_METHODS}")
    world, rank = start_distributed(args.seed)
    stages = 2 if args.engine == "pp2" else 1
    dp = world // stages
    source = hf_source(args.model, image_folder=args.images, video_folder=args.videos)
    shapes = source.read_shapes(args.data, "error")
    dataset = source.make_dataset(shapes, args.data)
    cost_model = load_cost_model(args.cost_model)
    ds_config = worker_ds_config(args.global_batch, args.gas, dp, zero_stage=2 if stages == 1 else None, bf16=args.bf16)
    bounds = stage_bounds(stages, shapes, cost_model)  # the training loop's split, on the cost model
    trainer = build_engine(*source.layers(), ds_config, pipeline_stages=stages, stage_bounds=bounds, lr=1e-4)
    dp_rank, dp_size = trainer.dp_coords
    samplers = {
        method: make_sampler(
            SamplerSettings(SPLITTERS[method], seed=args.seed, prefetch=0),
            shapes,
            global_batch_size=args.global_batch,
            gradient_accumulation_steps=args.gas,
            dp_rank=dp_rank,
            dp_size=dp_size,
            cost_model=method_cost_model(method, cost_model),
            label_tokens_fn=source.label_tokens_fn,
            sync=sync_model_of(ds_config, stages),
        )
        for method in methods
    }
    collates: dict[bool, Callable] = {False: source.collate}
    if PACKED_METHODS.intersection(methods):
        source.uses_packing(True)  # a clear error for a model without packed microbatches
        assert source.packed_collate is not None  # uses_packing(True) found one
        collates[True] = source.packed_collate
    batches = samplers[methods[0]].batches_in_epoch(0)
    rows = []
    for round_id in range(args.warmup + args.rounds):
        batch_id = round_id % len(batches)
        order = methods[round_id % len(methods) :] + methods[: round_id % len(methods)]
        for method in order:
            packed = method in PACKED_METHODS
            sched = samplers[method].schedule(0, batch_id, batches[batch_id])
            microbatches = [
                collates[packed]([dataset[ScheduledIndex(i, sched.loss_denominator, batch_id)] for i in mb])
                for mb in sched.split.ranks[dp_rank]
            ]
            loss, step_s = timed_train_step(trainer.train_step, microbatches)
            rows.append(
                round_row(
                    round_id,
                    args.warmup,
                    method,
                    step_s,
                    loss=loss,
                    **batch_tokens([mb for r in sched.split.ranks for mb in r], shapes, packed),
                )
            )
            if rank == 0:
                print(f"[hf] {args.engine} round {round_id:2d} {method:12s} step {step_s:.3f}s", flush=True)
    if rank == 0:
        Path(args.out).write_text(
            json.dumps(
                {"engine": args.engine, "rows": rows, "dp": dp_size, "stage_bounds": trainer.stage_bounds}, indent=1
            )
        )
    finish_rank(*samplers.values())
    return 0


if __name__ == "__main__":
    sys.exit(main())
