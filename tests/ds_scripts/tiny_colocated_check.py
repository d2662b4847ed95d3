"""Local vs colocated (dispatched) encoder, same global batches, on each engine ``--engines`` names:
``zero2`` (DeepSpeed's plain engine, ZeRO-2 over the world) and ``pp2`` (the pipeline engine, pp2 x
dp = world / 2, the encoder on the first stage or beside the pipeline).

Launched by tests/conftest.py (zero2 and pp2 on 2 ranks) and tests/test_colocated_pipe.py (pp2 on
4 ranks). For each mode (trainable / frozen encoder) two engines of the tiny model train the same
global batches with plain SGD (so a parameter change is the learning rate times the gradient): one
encodes each sample on its own rank (or stage), the other dispatches tiles by cost and exchanges
features. Rank 0 writes, per engine, the losses, the largest parameter difference after every step,
and how many tiles were encoded away from their sample's owner.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import RepeatingLoader

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflop_ds.cost import LLMOnlyCost, ProxyCost  # noqa: E402
from dflop_ds.data import read_dataset  # noqa: E402
from dflop_ds.models import TinyMLLMDataset, build_reference, collate_microbatch, supervised_count, tiny_mllm_layers  # noqa: E402
from dflop_ds.rank_lifecycle import finish_rank, share_cpu_threads  # noqa: E402
from dflop_ds.schedule.sampler import SamplerSettings, make_sampler  # noqa: E402
from dflop_ds.shapes import TINY_POLICY  # noqa: E402
from dflop_ds.sync import sync_model_of  # noqa: E402
from dflop_ds.train import build_engine  # noqa: E402
from dflop_ds.train.colocated import colocate, dispatch_microstep, pipeline_dispatch_ranks, tile_costs  # noqa: E402
from dflop_ds.train.gather import gather_full_state  # noqa: E402

SAMPLES, BATCH, GAS, LR = 64, 16, 2, 0.05


def run(mode: str, colocated: bool, shapes, dataset, steps: int):
    """``steps`` SGD steps of ZeRO-2 data parallel over the world, the encoder local or colocated."""
    ds_config = {
        "train_batch_size": BATCH,
        "gradient_accumulation_steps": GAS,
        "train_micro_batch_size_per_gpu": BATCH // (2 * GAS),
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
    }
    return run_engine(mode, colocated, shapes, dataset, steps, ds_config, pipeline_stages=1)


def run_engine(mode: str, colocated: bool, shapes, dataset, steps: int, ds_config: dict, pipeline_stages: int):
    """``steps`` SGD steps of the engine ``ds_config`` and ``pipeline_stages`` give; ``(losses,
    states, batches)`` and the ranks owning each data-parallel replica's samples (colocated)."""
    pipelined = pipeline_stages > 1
    trainer = build_engine(
        *tiny_mllm_layers(seed=0),
        ds_config,
        pipeline_stages=pipeline_stages,
        colocated=colocated,
        freeze_encoder=mode == "frozen",
        make_optimizer=lambda p: torch.optim.SGD(p, lr=LR),
    )
    dp_rank, dp_size = trainer.dp_coords
    sampler = make_sampler(
        SamplerSettings("dflop", prefetch=0),
        shapes,
        global_batch_size=ds_config["train_batch_size"],
        gradient_accumulation_steps=ds_config["gradient_accumulation_steps"],
        dp_rank=dp_rank,
        dp_size=dp_size,
        cost_model=LLMOnlyCost(ProxyCost()),
        label_tokens_fn=supervised_count,
        sync=sync_model_of(ds_config, pipeline_stages),
    )
    dispatch = pipeline_dispatch_ranks(trainer.engine) if pipelined else {}
    loader_parts = (sampler, dataset, collate_microbatch)
    if colocated:
        loader_parts = colocate(sampler, dataset, collate_microbatch, shapes, ProxyCost(), **dispatch)
    batch_sampler, data, collate = loader_parts
    data_iter = iter(
        RepeatingLoader(torch.utils.data.DataLoader(data, batch_sampler=batch_sampler, collate_fn=collate))
    )
    return train_steps(trainer, sampler, data_iter, steps), dispatch.get("owners")


def run_pipeline(mode: str, colocated: bool, shapes, dataset, steps: int):
    """``steps`` SGD steps of a pp2 engine (x dp = world / 2), the encoder in the pipeline or beside
    it (no gradient clipping)."""
    dp = torch.distributed.get_world_size() // 2
    ds_config = {
        "train_batch_size": 8 * dp,
        "gradient_accumulation_steps": GAS,
        "train_micro_batch_size_per_gpu": 8 // GAS,
        "steps_per_print": 10**9,
        "gradient_clipping": 0.0,
    }
    return run_engine(mode, colocated, shapes, dataset, steps, ds_config, pipeline_stages=2)


#: the engines a launch can compare the two encoders on
ENGINES = {"zero2": run, "pp2": run_pipeline}


def train_steps(trainer, sampler, data_iter, steps: int):
    """``(losses, full states, global batches)`` of ``steps`` steps."""
    losses, states, batches = [], [], []
    for _ in range(steps):
        losses.append(trainer.train_step(data_iter))
        states.append(gather_full_state(trainer))
        batches.append(sampler.last_schedule.split.ranks)
    return losses, states, batches


def foreign_tiles(batches, shapes, owners=None) -> int:
    """Tiles the dispatch plans encode on another rank than their sample's owner (data-parallel
    rank ``d``'s samples owned by rank ``owners[d]``; default: rank ``d``)."""
    tiles, per_tile = tile_costs(ProxyCost(), shapes)
    count = 0
    for ranks in batches:
        owned_by = list(range(len(ranks))) if owners is None else owners
        for k in range(len(ranks[0])):
            plan = dispatch_microstep(
                [rank[k] for rank in ranks], tiles, per_tile, owned_by, torch.distributed.get_world_size()
            )
            count += sum(p.tiles for rank, work in enumerate(plan.work) for p in work if p.owner != rank)
    return count


def main() -> int:
    """Compare each ``--engines`` engine's ``run(mode, colocated, shapes, dataset, steps) ->
    ((losses, states, batches), owners)`` local vs colocated in each mode; rank 0 writes the
    reports, ``--out``/<engine>.json."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True, help="folder of the reports")
    parser.add_argument("--engines", default="zero2", help=f"comma-separated, of {sorted(ENGINES)}")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--modes", default="trainable,frozen")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    share_cpu_threads()
    shapes = read_dataset(ROOT / "examples" / "data" / "mixture.jsonl", TINY_POLICY)[:SAMPLES]
    dataset = TinyMLLMDataset(shapes, seed=0)
    for engine in args.engines.split(","):
        report = compare(ENGINES[engine], shapes, dataset, args.steps, args.modes.split(","))
        if torch.distributed.get_rank() == 0:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"{engine}.json").write_text(json.dumps(report, indent=1))
    finish_rank()
    return 0


def compare(run, shapes, dataset, steps: int, modes: list[str]) -> dict:
    """Rank 0: each mode's local and colocated losses, parameter differences, tiles moved and samples."""
    initial = build_reference(seed=0).state_dict()
    n_encoder = len(tiny_mllm_layers(seed=0, as_specs=False)[0])
    report = {}
    for mode in modes:
        local, _ = run(mode, False, shapes, dataset, steps)
        colo, owners = run(mode, True, shapes, dataset, steps)
        if torch.distributed.get_rank() != 0:
            continue
        assert local[2] == colo[2], "the two runs trained different global batches"
        assert all(set(a) == set(b) for a, b in zip(local[1], colo[1])), "the two runs name parameters differently"
        diffs = [max(float((a[k] - b[k]).abs().max()) for k in a) for a, b in zip(local[1], colo[1])]
        moved = max(float((local[1][-1][k] - initial[k]).abs().max()) for k in initial)
        encoder_moved = max(
            float((colo[1][-1][k] - initial[k]).abs().max()) for k in initial if int(k.split(".")[0]) < n_encoder
        )
        report[mode] = {
            "losses_local": local[0],
            "losses_colocated": colo[0],
            "max_param_diff": diffs,
            "max_param_change": moved,
            "encoder_change_colocated": encoder_moved,
            "foreign_tiles": foreign_tiles(colo[2], shapes, owners),
            "samples": sorted(i for ranks in colo[2] for rank in ranks for mb in rank for i in mb),
        }
    return report


if __name__ == "__main__":
    sys.exit(main())
