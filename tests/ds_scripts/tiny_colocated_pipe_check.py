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

import torch
from tiny_colocated_check import main, run_engine  # the same comparison as on the plain engine

GAS = 2


def run_pipeline(mode: str, colocated: bool, shapes, dataset, steps: int):
    """``steps`` SGD steps of a pp2 engine (x dp = world / 2), the encoder in the pipeline or beside it."""
    dp = torch.distributed.get_world_size() // 2
    ds_config = {
        "train_batch_size": 8 * dp,
        "gradient_accumulation_steps": GAS,
        "train_micro_batch_size_per_gpu": 8 // GAS,
        "steps_per_print": 10**9,
        "gradient_clipping": 0.0,
    }
    return run_engine(mode, colocated, shapes, dataset, steps, ds_config, pipeline_stages=2)


if __name__ == "__main__":
    sys.exit(main(run_pipeline))
