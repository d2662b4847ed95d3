"""The training script's options and settings: its argument parser, the config it reads, the plan it follows.

Light on purpose (no DeepSpeed import), so that ``dflop-ds check-launch`` can take the same options.
The training loop (:mod:`dflop_ds.train.loop`):

    deepspeed --num_gpus 2 examples/train.py --deepspeed_config ds_configs/tiny_mllm_pp2.json
    deepspeed --num_gpus 2 examples/train.py --deepspeed_config ds_configs/hf_zero2.json \\
        --model_name_or_path MODEL_DIR --data_path data.json --image_folder images/

The config's ``"dflop"`` block (:class:`dflop_ds.config.DFLOPConfig`) chooses the sampler, the
data, the pipeline stages (``> 1``: DeepSpeed's pipeline engine; ``1``: the plain engine with
the config's ZeRO stage) and the stage split. Without ``--model_name_or_path`` the bundled tiny
MLLM trains on synthetic tensors of the dataset's real shapes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dflop_ds.config import DFLOPConfig, fill_from_plan, get_setting, plan_path, set_settings
from dflop_ds.deepspeed_keys import deepspeed_keys
from dflop_ds.jsonio import read_json_object
from dflop_ds.plan import Plan
from dflop_ds.precision import check_precisions
from dflop_ds.schedule.splitters import splitter_names

#: command-line options that override settings of the "dflop" block (option dest -> DFLOPConfig attribute)
BLOCK_OVERRIDES = {
    "sampler": "sampler",
    "steps": "steps",
    "data": "data",
    "data_path": "data",
    "cost_model": "cost_model",
    "model_name_or_path": "model_name_or_path",
    "image_folder": "image_folder",
    "video_folder": "video_folder",
    "packing": "packing",
}


def true_or_false(value: str) -> bool:
    """``"true"`` / ``"false"`` (any case) as a bool, for boolean command-line overrides."""
    choices = {"true": True, "false": False}
    if value.lower() not in choices:
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return choices[value.lower()]


def build_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The training script's options (LLaVA's names for model and data); ``add_help=False`` for a
    parent parser (``dflop-ds check-launch`` takes the same options)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, add_help=add_help
    )
    parser.add_argument("--deepspeed_config", required=True, help='DeepSpeed JSON config with a "dflop" block')
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument(
        "--model_name_or_path", help="a HuggingFace save_pretrained directory (default: the tiny model)"
    )
    parser.add_argument("--data_path", help="LLaVA JSON/JSONL or shape manifest (overrides dflop.data.path)")
    parser.add_argument("--data", help="alias of --data_path")
    parser.add_argument("--image_folder", help="folder the records' image paths are relative to")
    parser.add_argument("--video_folder", help="folder the records' video paths are relative to")
    parser.add_argument("--sampler", choices=splitter_names(), help="override dflop.sampler.kind")
    parser.add_argument("--steps", type=int, help="override dflop.train.steps")
    parser.add_argument("--packing", type=true_or_false, help="override dflop.model.packing (true or false)")
    parser.add_argument(
        "--cost-model",
        dest="cost_model",
        help="override dflop.sampler.cost_model: a cost-model JSON, or "
        "'proxy' for the unitless proxy (default: the tiny model profiled once, cached)",
    )
    parser.add_argument("--output_dir", help="write the trained model here at the end (save_pretrained for HF models)")
    parser.add_argument("--summary", help="write the run's figures as JSON to this path (rank 0)")
    parser.add_argument(
        "--trace", help="append the samples each step trained, one JSON line per step and data-parallel rank"
    )
    parser.add_argument(
        "--telemetry",
        help="append per-step telemetry JSON lines here (rank 0; default: "
        "dflop_telemetry.jsonl in the csv_monitor folder)",
    )
    parser.add_argument("--resume", action="store_true", help="resume from dflop.train.checkpoint_dir")
    parser.add_argument(
        "--exit-after-step", type=int, help="stop abruptly (no clean-up) after this step: simulates a crash in tests"
    )
    return parser


def load_settings(args: argparse.Namespace, *, check_device: bool = True) -> tuple[dict, DFLOPConfig]:
    """The DeepSpeed config without its "dflop" block, and the validated "dflop" block; a precision
    this machine's device cannot train in is refused unless ``check_device`` is false (a dry run
    on another machine than the launch's)."""
    ds_config, cfg, _ = load_run_settings(args, check_device=check_device)
    return ds_config, cfg


def load_run_settings(args: argparse.Namespace, *, check_device: bool = True) -> tuple[dict, DFLOPConfig, Plan | None]:
    """:func:`load_settings` and the plan the run follows (None: none), its file read once."""
    loaded: Plan | None = None
    ds_config = read_json_object(args.deepspeed_config)
    block = ds_config.pop("dflop", {})
    for option, key in BLOCK_OVERRIDES.items():
        value = getattr(args, option, None)
        if value is not None:
            set_settings(block, **{key: value})
    if args.resume:
        set_settings(block, resume=True)
    plan = get_setting(block, "plan")
    if isinstance(plan, str) and plan:  # `dflop-ds plan` fills batch keys, the split, what its memory model assumed
        resolved = plan_path(plan, args.deepspeed_config)
        if not Path(resolved).is_file():
            raise ValueError(
                f"{args.deepspeed_config}: {DFLOPConfig.path('plan')} {plan!r} (relative to the config's folder):"
                f" no plan file at {resolved}"
            )
        set_settings(block, plan=resolved)
        loaded = load_plan(resolved)
        ds_config, block = fill_from_plan(ds_config, block, loaded)
    where = f"plan {get_setting(block, 'plan')}" if plan else f"DeepSpeed config {args.deepspeed_config}"
    try:  # a malformed ZeRO stage, or "auto" (the HF Trainer's to fill in, not this loop's): refused before DeepSpeed
        keys = deepspeed_keys(ds_config)
        keys.check_stage_given()
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    if check_device:
        check_precisions(keys.precisions, where)  # refused here, before DeepSpeed does
    cfg = DFLOPConfig.from_dict(block, source=args.deepspeed_config)
    return ds_config, cfg, loaded if loaded is not None else load_plan(cfg.plan.file)


def load_plan(path: str | None):
    """The plan the run must match, or None (a missing or malformed file raises naming it)."""
    if path is None:
        return None
    return Plan.load(path)
