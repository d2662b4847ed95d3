"""ZeRO-3's coalesced gather replaced by :func:`dflop_ds.zero_gather.install_waited_gather`, on the
installed DeepSpeed, as a from_pretrained under ZeRO-3 uses it: modules of a weight and a bias
built under ``zero.Init``, each written on rank 0 inside ``GatheredParameters(modifier_rank=0)``
(one coalesced gather of both) and gathered again; every rank checks it reads what rank 0 wrote.
Run on 2 ranks by tests/test_zero_gather.py; exits 1 naming the first parameter that differs."""

from __future__ import annotations

import os
import sys

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from dflop_ds.zero_gather import install_waited_gather

ZERO3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def main() -> int:
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    install_waited_gather()
    install_waited_gather()  # idempotent: the second call wraps nothing
    with deepspeed.zero.Init(config_dict_or_path=ZERO3):
        layers = torch.nn.ModuleList(torch.nn.Linear(256, 512) for _ in range(8))
    rank = torch.distributed.get_rank()
    for index, layer in enumerate(layers):
        params = list(layer.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
            if rank == 0:
                for offset, param in enumerate(params):
                    param.copy_(torch.arange(param.numel(), dtype=param.dtype).view_as(param) + index + offset)
        with deepspeed.zero.GatheredParameters(params):
            for offset, (name, param) in enumerate(layer.named_parameters()):
                expected = torch.arange(param.numel(), dtype=param.dtype).view_as(param) + index + offset
                if not torch.equal(param.detach().cpu(), expected):
                    print(f"rank {rank}: layers.{index}.{name} differs from what rank 0 wrote", flush=True)
                    return 1
    print(f"rank {rank}: {len(layers)} layers gathered as written", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    if code == 0:
        torch.distributed.barrier()  # both ranks done with every gather before either leaves
    sys.stdout.flush()
    sys.stderr.flush()
    # leave without running C++ destructors: ZeRO-3's gather threads, still joinable at interpreter
    # exit, abort a rank now and then ("terminate called without an active exception")
    os._exit(code)
