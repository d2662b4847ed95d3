"""Shared by the two-stage pipeline check scripts (hf_pipe_check.py, tiny_pipe_train.py): their
options, the engine under test, step 1 against a one-process reference, the per-rank report."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from dflop_ds.pipe.module import ANCHOR
from dflop_ds.rank_lifecycle import finish_rank
from dflop_ds.train import build_engine


def add_pipeline_options(parser: argparse.ArgumentParser, *, steps: int) -> None:
    """The options both scripts take: report folder, frozen encoder, stage bounds, steps, learning rate."""
    parser.add_argument("--out", required=True)
    parser.add_argument("--freeze", action="store_true")
    parser.add_argument("--bounds", default="", help="comma-separated stage bounds; default encoder_stages=1")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--local_rank", type=int, default=0)


def start_distributed() -> tuple[int, torch.device]:
    """One thread per rank, the process group joined: ``(rank, device)``."""
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    return torch.distributed.get_rank(), torch.device(get_accelerator().device_name())


def sgd(params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The optimizer of the engine and of the reference alike."""
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def pipeline_trainer(
    encoder: Sequence[torch.nn.Module],
    projector: torch.nn.Module,
    llm: Sequence[torch.nn.Module],
    args: argparse.Namespace,
    gas: int,
    dp: int,
    **engine_options: Any,
) -> Any:
    """The 2-stage engine under test: ``--bounds`` or, by default, the encoder and projector alone
    on stage 0; microbatches of 1, ``gas`` of them per step; SGD at ``--lr``; no gradient clipping."""
    bounds = (
        [int(b) for b in args.bounds.split(",")] if args.bounds else [0, len(encoder) + 1, len(encoder) + 1 + len(llm)]
    )
    config = {
        "train_batch_size": gas * dp,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 10**9,
        # DeepSpeed clips each pipeline stage by its own norm (not the global one); clipping is
        # off so that step 1 can match the reference exactly
        "gradient_clipping": 0.0,
    }
    # a stage holding only the frozen encoder gets a zero anchor parameter (the engine needs an optimizer)
    return build_engine(
        encoder,
        projector,
        llm,
        config,
        pipeline_stages=2,
        stage_bounds=bounds,
        freeze_encoder=args.freeze,
        make_optimizer=lambda params: sgd(params, args.lr),
        **engine_options,
    )


def model_weights(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The stage's named parameters that are weights of the model (not a frozen stage's anchor)."""
    return [(name, p) for name, p in model.named_parameters() if name != ANCHOR]


def step_gaps(
    model: torch.nn.Module, reference: dict[str, torch.Tensor], before: dict[str, torch.Tensor]
) -> tuple[float, float]:
    """``(largest |parameter - reference|, largest |parameter - before|)`` over the stage's parameters."""
    max_diff = max_change = 0.0
    for name, p in model_weights(model):
        max_diff = max(max_diff, float((p.detach() - reference[name].detach()).abs().max()))
        max_change = max(max_change, float((p.detach() - before[name]).abs().max()))
    return max_diff, max_change


def parameter_counts(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The stage's parameter count, its frozen count, and whether a frozen parameter moved since ``before``."""
    return {
        "n_params": sum(p.numel() for _, p in model_weights(model)),
        "n_frozen": sum(p.numel() for _, p in model_weights(model) if not p.requires_grad),
        "frozen_moved": any(
            not torch.equal(p.detach(), before[n]) for n, p in model_weights(model) if not p.requires_grad
        ),
    }


def write_report(out: str, rank: int, result: dict[str, Any], *, last: bool = True) -> None:
    """``out/rank<rank>.json``; after the ``last`` report, the rank's clean shutdown (:func:`finish_rank`)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    if last:
        finish_rank()


def variants(parser: argparse.ArgumentParser) -> list[tuple[argparse.Namespace, bool]]:
    """The script's runs, in one process group: its own options, or one run per ``--variant
    NAME=OPTIONS`` (the options added to the others, the reports under ``--out``/NAME); each with
    whether it is the last."""
    argv = sys.argv[1:]
    at = [i for i, arg in enumerate(argv) if arg == "--variant"]
    if not at:
        return [(parser.parse_args(argv), True)]
    common = [arg for i, arg in enumerate(argv) if i not in at and i - 1 not in at]
    runs = []
    for i in at:
        name, _, options = argv[i + 1].partition("=")
        run = parser.parse_args([*common, *shlex.split(options)])
        run.out = os.path.join(run.out, name)
        runs.append((run, i == at[-1]))
    return runs
