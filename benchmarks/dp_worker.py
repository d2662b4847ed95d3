"""One rank of the data-parallel benchmark (launched by bench_dp.py under `deepspeed`).

Three engines of the tiny MLLM on the plain engine: two under ZeRO-2, one encoding each sample on
its own rank, the other dispatching the encoder's tiles by cost (:mod:`dflop_ds.train.colocated`),
and one under ZeRO-3 with the ZeRO block of ``--zero3-config`` (buckets below a layer's size,
so the encoder and the LLM meet apart), the encoder local. Every
method trains the same global batches, interleaved round by round (the order rotates every
round). Stock and LLaVA pad their microbatches; verl and dflop-ds pack them, as their users
run them (packed microbatches: :mod:`dflop_ds.models.packing`). Per step it records the wall
time and each rank's encoder seconds (forward: from the first encoder layer's input to the
last one's output; backward: from the gradient reaching the encoder's output to the last
encoder parameter's gradient, ZeRO's hooks on those parameters included).
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
from benchmarks.e2e_methods import PACKED_METHODS, split_for  # noqa: E402
from dflop_ds.cost import load_cost_model, sampler_cost_model  # noqa: E402
from dflop_ds.data import read_dataset  # noqa: E402
from dflop_ds.jsonio import read_json_object  # noqa: E402
from dflop_ds.models import (  # noqa: E402
    TinyMLLMDataset,
    collate_microbatch,
    collate_packed_microbatch,
    supervised_count,
    tiny_mllm_layers,
)
from dflop_ds.rank_lifecycle import finish_rank  # noqa: E402
from dflop_ds.schedule.dispatch import plan_dispatch  # noqa: E402
from dflop_ds.schedule.epoch import epoch_permutation, global_batches  # noqa: E402
from dflop_ds.schedule.index import ScheduledIndex  # noqa: E402
from dflop_ds.shapes import TINY_POLICY  # noqa: E402
from dflop_ds.sync import sync_model_of  # noqa: E402
from dflop_ds.train import TrainingEngine, build_engine  # noqa: E402
from dflop_ds.train.colocated import DispatchCollate, DispatchDataset, MicrostepRequest, tile_costs  # noqa: E402
from dflop_ds.train.loop import start_distributed  # noqa: E402

METHODS = ("stock", "llava", "verl", "dflop", "dflop_dispatch", "stock_z3", "llava_z3", "verl_z3", "dflop_z3")
#: the split of each method (:func:`benchmarks.e2e_methods.split_for`): dflop_dispatch is dflop
#: balancing the LLM alone, its encoder's tiles dispatched over the ranks; verl and dflop-ds pack
#: their microbatches as their users run them (:data:`benchmarks.e2e_methods.PACKED_METHODS`); a
#: ``_z3`` method is its ZeRO-2 namesake's split trained under ZeRO-3
SPLITS = {"stock": "stock", "llava": "llava", "verl": "verl", "dflop": "dflop", "dflop_dispatch": "dflop_colocated"}
SPLITS |= {f"{method}_z3": SPLITS[method] for method in ("stock", "llava", "verl", "dflop")}


class EncoderClock:
    """Encoder seconds of one rank, forward and backward, summed until :meth:`take`."""

    def __init__(self, module: torch.nn.Module, n_encoder: int) -> None:
        layers = list(module)[:n_encoder]
        self.seconds = 0.0
        self._forward_start = self._backward_start = self._backward_end = None
        layers[0].register_forward_pre_hook(self._start)
        layers[-1].register_forward_hook(self._end)
        for param in (p for layer in layers for p in layer.parameters() if p.requires_grad):
            param.register_post_accumulate_grad_hook(self._grad_done)

    def _close_backward(self) -> None:
        if self._backward_start is not None and self._backward_end is not None:
            self.seconds += max(self._backward_end - self._backward_start, 0.0)
        self._backward_start = self._backward_end = None

    def _start(self, *_):
        self._close_backward()
        self._forward_start = time.perf_counter()

    def _end(self, _module, _inputs, output):
        self.seconds += time.perf_counter() - self._forward_start
        if output[0].requires_grad:
            output[0].register_hook(self._grad_arrived)

    def _grad_arrived(self, grad):
        self._backward_start = time.perf_counter()
        return grad

    def _grad_done(self, _param):
        self._backward_end = time.perf_counter()

    def take(self) -> float:
        """Seconds since the last call."""
        self._close_backward()
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--zero3-config", default=str(ROOT / "ds_configs" / "zero3_small_buckets.json"))
    add_worker_options(parser, global_batch=32, gas=4, rounds=8)
    return parser.parse_args()


def engine_config(gas: int, global_batch: int, dp: int, zero: dict | None = None) -> dict:
    """The DeepSpeed config of an engine: ZeRO-2, or the ZeRO block ``zero``."""
    config = worker_ds_config(global_batch, gas, dp, zero_stage=2)
    if zero is not None:
        config["zero_optimization"] = zero
    return config


def zero_engine(colocated: bool, config: dict, seed: int) -> TrainingEngine:
    """The tiny MLLM on the plain engine under ``config``."""
    return build_engine(*tiny_mllm_layers(seed=seed), config, pipeline_stages=1, colocated=colocated, lr=1e-3)


def main() -> int:
    args = parse_args()
    dp, rank = start_distributed(args.seed)
    shapes = read_dataset(args.data, TINY_POLICY)
    dataset = TinyMLLMDataset(shapes, seed=args.seed)
    cost_model = load_cost_model(args.cost_model)
    costs = {packed: sampler_cost_model(cost_model, packed=packed).predict_samples(shapes) for packed in (False, True)}
    tiles, per_tile = tile_costs(cost_model, shapes)
    labels = np.array([supervised_count(s) for s in shapes])
    methods = args.methods.split(",")
    configs = {name: engine_config(args.gas, args.global_batch, dp) for name in ("local", "colocated")}
    if any(method.endswith("_z3") for method in methods):
        zero3 = read_json_object(args.zero3_config)["zero_optimization"]
        configs["zero3"] = engine_config(args.gas, args.global_batch, dp, zero3)
    engines = {name: zero_engine(name == "colocated", config, args.seed) for name, config in configs.items()}
    syncs = {name: sync_model_of(config) for name, config in configs.items()}  # how each engine's ranks meet
    n_encoder = engines["local"].module.n_encoder_layers
    clocks = {name: EncoderClock(trainer.module, n_encoder) for name, trainer in engines.items()}
    dispatch_data, dispatch_collate = DispatchDataset(dataset), DispatchCollate(collate_packed_microbatch, tiles)
    batches = global_batches(epoch_permutation(len(shapes), args.seed, 0), args.global_batch, args.gas * dp)
    rows = []
    for round_id in range(args.warmup + args.rounds):
        batch = batches[round_id % len(batches)].tolist()
        group = [shapes[i] for i in batch]
        denominator = max(int(labels[batch].sum()), 1) / (args.gas * dp)
        order = methods[round_id % len(methods) :] + methods[: round_id % len(methods)]
        for method in order:
            name = "colocated" if method == "dflop_dispatch" else "zero3" if method.endswith("_z3") else "local"
            start = time.perf_counter()
            packed = SPLITS[method] in PACKED_METHODS
            split = split_for(
                SPLITS[method],
                batch,
                shapes,
                costs[packed][batch],
                args.gas,
                dp,
                microbatch_cost=lambda pos, g=group: cost_model.predict_microbatch([g[p] for p in pos]),
                seed=args.seed + round_id,
                sync=syncs[name],
            )
            own = [[ScheduledIndex(i, denominator) for i in mb] for mb in split[rank]]
            if method == "dflop_dispatch":
                plans = [plan_dispatch([r[k] for r in split], tiles, per_tile) for k in range(args.gas)]
                microbatches = [
                    dispatch_collate([dispatch_data[MicrostepRequest(mb, plan, rank)]]) for mb, plan in zip(own, plans)
                ]
                predicted = np.sum([plan.loads for plan in plans], axis=0)
            else:
                microbatches = [collate_microbatch([dataset[i] for i in mb], packed=packed) for mb in own]
                predicted = np.array([sum(tiles[i] * per_tile[i] for mb in r for i in mb) for r in split])
            schedule_s = time.perf_counter() - start
            clocks[name].take()
            loss, step_s = timed_train_step(engines[name].train_step, microbatches)
            encoder = [0.0] * dp
            torch.distributed.all_gather_object(encoder, clocks[name].take())
            rows.append(
                round_row(
                    round_id,
                    args.warmup,
                    method,
                    step_s,
                    schedule_s=schedule_s,
                    encoder_s=encoder,
                    predicted_encoder=predicted.tolist(),
                    samples=len(batch),
                    loss=loss,
                )
            )
            if rank == 0:
                print(
                    f"[dp] round {round_id:2d} {method:15s} step {step_s:.3f}s encoder "
                    f"{' '.join(f'{e:.3f}' for e in encoder)}",
                    flush=True,
                )
    if rank == 0:
        Path(args.out).write_text(
            json.dumps({"rows": rows, "dp": dp, "global_batch": args.global_batch, "gas": args.gas}, indent=1)
        )
    finish_rank()
    return 0


if __name__ == "__main__":
    sys.exit(main())
