"""One rank of `make test-frameworks`' ZeRO-3 loading check, in a framework's environment:
``python -m torch.distributed.run --nproc_per_node 2 THIS MODEL_DIR``.

Starts DeepSpeed's communication and :func:`dflop_ds.zero_gather.wait_every_gather` as both
plugins do, loads ``MODEL_DIR`` with ``from_pretrained`` under a ZeRO-3 config (``zero.Init``, the
checkpoint written into the partitions one module at a time), gathers every parameter and compares
it with the same checkpoint loaded without ZeRO. On DeepSpeed before 0.19.8 on CPU ranks, without
the plugins' fix, parts of the weights keep the memory the gather buffers held (the NaN losses of
LLaMA-Factory 0.9.5's ZeRO-3 runs). Rank 0 prints ``weights ok: N parameters`` or names every
parameter that differs, and the rank exits 1. Each rank ends with :func:`~dflop_ds.rank_lifecycle.finish_rank`.
"""

from __future__ import annotations

import sys

import deepspeed
import torch
from transformers import AutoModelForImageTextToText
from transformers.integrations import HfDeepSpeedConfig

from dflop_ds.rank_lifecycle import finish_rank
from dflop_ds.zero_gather import wait_every_gather

#: every parameter partitioned (none kept whole on every rank), as the frameworks' ZeRO-3 runs
ZERO3 = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def differing(model: torch.nn.Module, reference: torch.nn.Module) -> list[str]:
    """The names of ``model``'s (ZeRO-3 partitioned) parameters that differ from ``reference``'s, with
    their largest absolute value."""
    expected = dict(reference.named_parameters())
    wrong = []
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            if not torch.equal(param.detach(), expected[name].detach()):
                wrong.append(f"{name} (max |w| {param.detach().abs().max().item():.3g})")
    return wrong


def main(model_dir: str) -> int:
    deepspeed.init_distributed()
    wait_every_gather()
    reference = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    config = HfDeepSpeedConfig(ZERO3)  # noqa: F841 (from_pretrained reads it while it is alive)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    wrong = differing(model, reference)
    if torch.distributed.get_rank() == 0:
        count = sum(1 for _ in model.parameters())
        print(f"weights ok: {count} parameters" if not wrong else f"{len(wrong)} of {count} differ: {wrong}")
    # the process group is not left to the interpreter's teardown, where gloo's threads can abort
    # a rank that has finished (``terminate called without an active exception``, exit -6)
    finish_rank()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
