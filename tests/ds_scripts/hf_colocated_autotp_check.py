"""A tiny HF LLaVA with the colocated (dispatched) encoder: ZeRO-2 dp2 and AutoTP tp2 against the
local encoder, same global batches, on 2 ranks.

Launched by tests/test_colocated_autotp.py under `deepspeed --num_gpus 2`. Four engines train
the same global batches with plain SGD and no clipping (a parameter change is the learning rate
times the gradient), each from a fresh copy of the model: ``local`` (ZeRO-2 dp2, every rank
encodes its own samples: the unsharded reference), ``colocated`` (ZeRO-2 dp2, tiles dispatched by
cost, features exchanged), ``autotp`` (tp2: the LLM sharded by DeepSpeed AutoTP, both ranks
training the same microbatches, the group's tiles dispatched over both ranks and every feature
sent to both) and ``autotp_local`` (tp2, both ranks encoding all the group's images). Rank 0
writes, per run, the losses, the largest parameter difference to the reference after every step
(the encoder's apart), the samples of every step and the tiles encoded away from their owner.
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
from tiny_colocated_check import foreign_tiles, train_steps  # the plain engine's comparison helpers

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflop_ds.cost import LLMOnlyCost, ProxyCost  # noqa: E402
from dflop_ds.models.hf.source import hf_source  # noqa: E402
from dflop_ds.rank_lifecycle import finish_rank, share_cpu_threads  # noqa: E402
from dflop_ds.schedule.sampler import SamplerSettings, make_sampler  # noqa: E402
from dflop_ds.sync import sync_model_of  # noqa: E402
from dflop_ds.train import build_engine  # noqa: E402
from dflop_ds.train.colocated import colocate  # noqa: E402

SAMPLES, BATCH, GAS, LR = 24, 8, 2, 0.5
ZERO2 = {
    "steps_per_print": 10**9,
    "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 2},
    "zero_allow_untested_optimizer": True,
}
TP2 = {
    **ZERO2,
    "train_batch_size": 2 * BATCH,
    "train_micro_batch_size_per_gpu": BATCH // GAS,
    "tensor_parallel": {"autotp_size": 2},
}
RUNS = {  # name -> (colocated, DeepSpeed config)
    "local": (False, {**ZERO2, "train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // (2 * GAS)}),
    "colocated": (True, {**ZERO2, "train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // (2 * GAS)}),
    # DeepSpeed counts both ranks of the tensor-parallel group in train_batch_size
    "autotp": (True, TP2),
    "autotp_local": (False, TP2),
}


def run(name: str, model: str, data: str, images: str, steps: int):
    """``steps`` SGD steps of run ``name`` on a fresh copy of the model; ``((losses, states,
    batches), owners)`` with ``owners`` the ranks owning each data-parallel replica's samples."""
    colocated, config = RUNS[name]
    source = hf_source(model, image_folder=images)
    shapes = source.read_shapes(data, "error")[:SAMPLES]
    dataset = source.make_dataset(shapes, data)
    trainer = build_engine(
        *source.layers(),
        {**config, "gradient_accumulation_steps": GAS},
        pipeline_stages=1,
        colocated=colocated,
        hf_model=source.hf_model,
        make_optimizer=lambda p: torch.optim.SGD(p, lr=LR),
    )
    dp_rank, dp_size = trainer.dp_coords
    sampler = make_sampler(
        SamplerSettings("dflop", prefetch=0),
        shapes,
        global_batch_size=trainer.global_batch_size,
        gradient_accumulation_steps=GAS,
        dp_rank=dp_rank,
        dp_size=dp_size,
        cost_model=LLMOnlyCost(ProxyCost()),
        label_tokens_fn=source.label_tokens_fn,
        sync=sync_model_of(ZERO2),
    )
    parts = (sampler, dataset, source.collate)
    dispatch = trainer.dispatch_ranks() if colocated else {}
    if colocated:
        parts = colocate(*parts, shapes, ProxyCost(), pixels_of=source.colocated_tile_pixels(), **dispatch)
    batch_sampler, items, collate = parts
    data_iter = iter(
        RepeatingLoader(torch.utils.data.DataLoader(items, batch_sampler=batch_sampler, collate_fn=collate))
    )
    return train_steps(trainer, sampler, data_iter, steps), shapes, dispatch.get("owners")


def max_diff(a: dict, b: dict, keys) -> float:
    """Largest absolute difference of the tensors ``keys`` of two states."""
    return max(float((a[k] - b[k]).abs().max()) for k in keys)


def main() -> int:
    """Train every run of :data:`RUNS`; rank 0 writes the report (see the module docstring)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--images", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    share_cpu_threads()
    results = {name: run(name, args.model, args.data, args.images, args.steps) for name in RUNS}
    if torch.distributed.get_rank() == 0:
        (_, reference, _), shapes, _ = results["local"]
        initial = hf_source(args.model, image_folder=args.images)
        n_encoder = len(initial.encoder_layers)
        keys = list(reference[0])
        encoder = [k for k in keys if int(k.split(".")[0]) < n_encoder]
        start = flat_state(initial)
        report = {}
        for name, ((losses, states, batches), _, owners) in results.items():
            assert set(states[0]) == set(keys), f"{name} names its parameters differently"
            report[name] = {
                "losses": losses,
                "max_param_diff": [max_diff(s, r, keys) for s, r in zip(states, reference)],
                "max_encoder_diff": [max_diff(s, r, encoder) for s, r in zip(states, reference)],
                "max_param_change": max_diff(states[-1], start, keys),
                "max_encoder_change": max_diff(states[-1], start, encoder),
                "samples": [sorted(i for rank in ranks for mb in rank for i in mb) for ranks in batches],
                "foreign_tiles": foreign_tiles(batches, shapes, owners) if RUNS[name][0] else 0,
            }
        Path(args.out).write_text(json.dumps(report, indent=1))
    finish_rank()
    return 0


def flat_state(source) -> dict[str, torch.Tensor]:
    """The untrained model's tensors under the flat names (``"<layer index>.<name>"``)."""
    layers = [*source.encoder_layers, source.projector, *source.llm_layers]
    return {f"{i}.{k}": v.detach().clone() for i, layer in enumerate(layers) for k, v in layer.state_dict().items()}


if __name__ == "__main__":
    sys.exit(main())
