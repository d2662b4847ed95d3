"""In-pipeline vs colocated (dispatched, data parallel over all ranks) encoder on DeepSpeed's
pipeline engine, pp2 (2 ranks) or pp2 x dp2 (4 ranks), same global batches.

Launched by tests/test_colocated_pipe.py. For each mode (trainable / frozen encoder) two engines
of the tiny model train the same global batches with plain SGD and no gradient clipping (so a
parameter change is the learning rate times the gradient): one with the encoder on the first
pipeline stage, the other with the encoder beside the pipeline (:class:`ColocatedPipeline`).
Rank 0 writes the report of tiny_colocated_check.py (losses, the largest parameter difference
after every step under the in-pipeline layout's names, tiles encoded away from their owner).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from deepspeed.utils import RepeatingLoader
from tiny_colocated_check import main, train_steps  # the same comparison as on the plain engine

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflop_ds.models import collate_microbatch, supervised_count, tiny_mllm_layers  # noqa: E402
from dflop_ds.profile.proxy import ProxyCost  # noqa: E402
from dflop_ds.schedule.sampler import make_sampler  # noqa: E402
from dflop_ds.train import build_engine  # noqa: E402
from dflop_ds.train.colocated import LLMOnlyCost, colocate, pipeline_dispatch_ranks  # noqa: E402

GAS, LR = 2, 0.05


def run_pipeline(mode: str, colocated: bool, shapes, dataset, steps: int):
    """``steps`` SGD steps of a pp2 engine (x dp = world / 2), the encoder in the pipeline or beside it."""
    dp = torch.distributed.get_world_size() // 2
    batch = 8 * dp
    ds_config = {"train_batch_size": batch, "gradient_accumulation_steps": GAS,
                 "train_micro_batch_size_per_gpu": batch // (dp * GAS), "steps_per_print": 10**9,
                 "gradient_clipping": 0.0}
    trainer = build_engine(*tiny_mllm_layers(seed=0), ds_config, pipeline_stages=2, colocated=colocated,
                           freeze_encoder=mode == "frozen", make_optimizer=lambda p: torch.optim.SGD(p, lr=LR))
    dp_rank, dp_size = trainer.dp_coords
    sampler = make_sampler("dflop", shapes, global_batch_size=batch, gradient_accumulation_steps=GAS,
                           dp_rank=dp_rank, dp_size=dp_size, cost_model=LLMOnlyCost(ProxyCost()), prefetch=0,
                           label_tokens_fn=supervised_count, lockstep=False)
    owners, loader_parts = None, (sampler, dataset, collate_microbatch)
    if colocated:
        ranks = pipeline_dispatch_ranks(trainer.engine)
        owners = ranks["owners"]
        loader_parts = colocate(sampler, dataset, collate_microbatch, shapes, ProxyCost(), **ranks)
    batch_sampler, data, collate = loader_parts
    data_iter = iter(RepeatingLoader(torch.utils.data.DataLoader(data, batch_sampler=batch_sampler,
                                                                 collate_fn=collate)))
    return train_steps(trainer, sampler, data_iter, steps), owners


if __name__ == "__main__":
    sys.exit(main(run_pipeline))
