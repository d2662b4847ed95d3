"""``dflop-ds check-model MODEL_DIR``: compare the pipeline layer lists with the HF model."""

from __future__ import annotations

import argparse

from dflop_ds.commands.arg_types import positive_float
from dflop_ds.models.hf.check import check_model


def run_check_model(args: argparse.Namespace) -> int:
    """Print the one summary line; exit 1 when a relative error (against HF, or packed against
    padded) exceeds the tolerance."""
    report = check_model(args.model_dir, stages=args.stages, tolerance=args.tolerance, seed=args.seed)
    print(report.line())
    return 0 if report.ok else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``check-model`` sub-command."""
    parser = subparsers.add_parser(
        "check-model",
        help="check that the pipeline layer lists of a HF model directory match its own forward",
        description="Load a save_pretrained directory of a registered family (LLaVA, Qwen2-VL, LLaVA-OneVision, "
        "InternVL; model + processor, or tokenizer + image processor), split its layer lists into "
        "--stages stages, run synthetic microbatches (images inside prompts, text-only rows and "
        "microbatches, different lengths) stage by stage and through the HF model, and compare "
        "loss and logits; run every microbatch packed too and compare with the padded one "
        "(packed_rel_err). Exit 1 when max_rel_err or packed_rel_err exceeds --tolerance.",
    )
    parser.add_argument("model_dir", help="a save_pretrained directory (config, weights, processor)")
    parser.add_argument("--stages", type=int, default=1, help="pipeline stages to split the layers into (default 1)")
    parser.add_argument(
        "--tolerance", type=positive_float, default=1e-4, help="largest relative error allowed (default 1e-4)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic batches (default 0)")
    parser.set_defaults(func=run_check_model)
