"""One rank of the end-to-end benchmark (launched by bench_e2e.py under `deepspeed`).

All methods train the same global batches, interleaved round by round (the method order rotates
every round) so that the machine's drift hits them alike. Baselines run on a pipeline split by
layer count (DeepSpeed's ``partition_method="uniform"``); dflop-ds runs on its own engine with
the planner's stage split.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import add_worker_options, round_row, timed_train_step, worker_ds_config  # noqa: E402
from benchmarks.e2e_methods import METHODS, PACKED_METHODS, split_for  # noqa: E402
from dflop_ds.cost import load_cost_model, sampler_cost_model  # noqa: E402
from dflop_ds.data import read_dataset  # noqa: E402
from dflop_ds.models import (  # noqa: E402
    TinyMLLMConfig,
    TinyMLLMDataset,
    collate_microbatch,
    collate_packed_microbatch,
    supervised_count,
    tiny_mllm_layers,
)
from dflop_ds.rank_lifecycle import finish_rank  # noqa: E402
from dflop_ds.schedule.epoch import epoch_permutation, global_batches  # noqa: E402
from dflop_ds.schedule.index import ScheduledIndex  # noqa: E402
from dflop_ds.shapes import TINY_POLICY  # noqa: E402
from dflop_ds.telemetry.record import batch_tokens, bubble_fraction  # noqa: E402
from dflop_ds.telemetry.timers import PipelineTimer  # noqa: E402
from dflop_ds.train import TrainingEngine, build_engine  # noqa: E402
from dflop_ds.train.colocated import (  # noqa: E402
    DispatchCollate,
    DispatchDataset,
    MicrostepRequest,
    colocated_pipeline_bounds,
    dispatch_microstep,
    pipeline_dispatch_ranks,
    tile_costs,
)
from dflop_ds.train.loop import start_distributed  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", default=str(ROOT / "examples" / "data" / "mixture.jsonl"))
    parser.add_argument("--dflop-bounds", required=True, help="stage bounds of the dflop engine, e.g. 0,7,12")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--time-limit", type=float, default=0.0, help="dflop's exact-solver limit per batch")
    add_worker_options(parser, global_batch=32, gas=8, rounds=12)
    return parser.parse_args()


def pipeline_engine(bounds, gas: int, global_batch: int, dp: int, seed: int) -> TrainingEngine:
    """A 2-stage pipeline engine of the tiny MLLM with the given stage bounds (None: uniform)."""
    return build_engine(
        *tiny_mllm_layers(TinyMLLMConfig(), seed=seed),
        worker_ds_config(global_batch, gas, dp),
        pipeline_stages=2,
        stage_bounds=bounds,
        lr=1e-3,
    )


class ColocatedLoading:
    """The colocated method's engine (encoder beside a pipeline split over LLM layers by cost)
    and each rank's micro-steps of a split: own samples packed, plus the tiles it encodes."""

    def __init__(self, shapes, dataset, cost_model, gas: int, global_batch: int, dp: int, seed: int) -> None:
        encoder, projector, llm = tiny_mllm_layers(TinyMLLMConfig(), seed=seed)
        bounds = colocated_pipeline_bounds(None, len(encoder), cost_model, shapes, 2)
        self.trainer = build_engine(
            encoder,
            projector,
            llm,
            worker_ds_config(global_batch, gas, dp),
            pipeline_stages=2,
            stage_bounds=bounds,
            lr=1e-3,
            colocated=True,
        )
        self.dispatch = pipeline_dispatch_ranks(self.trainer.engine)
        self.dp_rank = self.trainer.dp_coords[0]
        self.tiles, self.tile_cost = tile_costs(cost_model, shapes)
        self.data, self.collate = DispatchDataset(dataset), DispatchCollate(collate_packed_microbatch, self.tiles)

    def microsteps(self, split, denominator: float) -> list:
        """This rank's ``(inputs, labels)`` of every micro-step of ``split``."""
        out = []
        for k in range(len(split[0])):
            plan = dispatch_microstep(
                [rank[k] for rank in split], self.tiles, self.tile_cost, self.dispatch["owners"], self.dispatch["ranks"]
            )
            own = [ScheduledIndex(i, denominator) for i in split[self.dp_rank][k]]
            out.append(self.collate([self.data[MicrostepRequest(own, plan, self.dispatch["rank"])]]))
        return out


def main() -> int:
    args = parse_args()
    world, rank = start_distributed(args.seed)
    dp = world // 2
    shapes = read_dataset(args.data, TINY_POLICY)
    dataset = TinyMLLMDataset(shapes, TinyMLLMConfig(), seed=args.seed)
    cost_model = load_cost_model(args.cost_model)
    costs = {packed: sampler_cost_model(cost_model, packed=packed).predict_samples(shapes) for packed in (False, True)}
    labels = np.array([supervised_count(s) for s in shapes])
    methods = args.methods.split(",")
    bounds = [int(b) for b in args.dflop_bounds.split(",")]
    engines = {
        "uniform": pipeline_engine(None, args.gas, args.global_batch, dp, args.seed),
        "dflop": pipeline_engine(bounds, args.gas, args.global_batch, dp, args.seed),
    }
    colocated = ColocatedLoading(shapes, dataset, cost_model, args.gas, args.global_batch, dp, args.seed)
    engines["colocated"] = colocated.trainer
    timers = {name: PipelineTimer(trainer.engine, args.gas).install() for name, trainer in engines.items()}
    dp_rank, _ = engines["dflop"].dp_coords
    batches = global_batches(epoch_permutation(len(shapes), args.seed, 0), args.global_batch, args.gas * dp)
    rows = []
    for round_id in range(args.warmup + args.rounds):
        batch = batches[round_id % len(batches)]
        denominator = max(int(labels[batch].sum()), 1) / (args.gas * dp)
        order = methods[round_id % len(methods) :] + methods[: round_id % len(methods)]
        for method in order:
            group = [shapes[i] for i in batch]
            packed = method in PACKED_METHODS
            start = time.perf_counter()
            split = split_for(
                method,
                batch.tolist(),
                shapes,
                costs[packed][batch],
                args.gas,
                dp,
                microbatch_cost=lambda pos, g=group: cost_model.predict_microbatch([g[p] for p in pos]),
                time_limit_s=args.time_limit,
                seed=args.seed + round_id,
            )
            schedule_s = time.perf_counter() - start
            if method == "dflop_colocated":
                microbatches = colocated.microsteps(split, denominator)
            else:
                microbatches = [
                    collate_microbatch([dataset[ScheduledIndex(i, denominator)] for i in mb], packed=packed)
                    for mb in split[dp_rank]
                ]
            name = {"dflop": "dflop", "dflop_colocated": "colocated"}.get(method, "uniform")
            timers[name].start_step()
            _, step_s = timed_train_step(engines[name].train_step, microbatches)
            compute = torch.tensor([float(timers[name].finish_step().compute.sum())])
            every_rank = [torch.zeros(1) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(every_rank, compute)
            rows.append(
                round_row(
                    round_id,
                    args.warmup,
                    method,
                    step_s,
                    schedule_s=schedule_s,
                    **batch_tokens([mb for r in split for mb in r], shapes, packed),
                    idle_fraction=bubble_fraction(np.array([float(c) for c in every_rank]), step_s),
                    **(colocated.trainer.colocated_pipeline.phase_s if method == "dflop_colocated" else {}),
                )
            )
            if rank == 0:
                print(f"[e2e] round {round_id:2d} {method:12s} step {step_s:.3f}s", flush=True)
    if rank == 0:
        Path(args.out).write_text(
            json.dumps(
                {"rows": rows, "dp": dp, "global_batch": args.global_batch, "gas": args.gas, "dflop_bounds": bounds},
                indent=1,
            )
        )
    finish_rank()
    return 0


if __name__ == "__main__":
    sys.exit(main())
