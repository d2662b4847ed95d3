"""``dflop-ds check-launch``: check a launch for N nodes x G GPUs without starting DeepSpeed.

    dflop-ds check-launch --nodes 2 --gpus-per-node 8 --deepspeed_config cfg.json \\
        --model_name_or_path MODEL_DIR --data_path data.json --image_folder images/

It takes the training script's options, so the command line of a launch can be checked as it is,
and runs the checks a launch runs at start-up (:func:`dflop_ds.setup_checks.check_training_setup`)
for the world size ``nodes x gpus_per_node``: pipeline stages and tensor-parallel size dividing
it, the batch arithmetic ``train_batch_size = micro x GAS x dp``, a plan made for this world size
and batch, a named cost model made for this model, and a data set holding a global batch. It
prints the figures it derived and the memory cap the run will take, or refuses naming the key at
fault. The model is built on the CPU (a HuggingFace model is loaded) to count its layers and read
its data.
"""

from __future__ import annotations

import argparse
from typing import Any

from dflop_ds.config import AUTO, OFF, DFLOPConfig
from dflop_ds.cost import load_cost_model
from dflop_ds.deepspeed_keys import deepspeed_keys
from dflop_ds.setup_checks import SetupError, check_cost_model_fits, check_training_setup, resolve_batch_keys
from dflop_ds.sync import sync_model_of
from dflop_ds.train.launch_inputs import PROXY
from dflop_ds.train.memory_cap import RunMemoryCap
from dflop_ds.train.options import build_parser, load_run_settings


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``check-launch`` to the ``dflop-ds`` command."""
    parser = subparsers.add_parser(
        "check-launch",
        parents=[build_parser(add_help=False)],
        help="check a config, plan and data set for N nodes x G GPUs (a dry run: DeepSpeed is not started)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", type=int, required=True, help="nodes of the launch (deepspeed --num_nodes)")
    parser.add_argument(
        "--gpus-per-node", type=int, required=True, help="GPUs (processes) per node (deepspeed --num_gpus)"
    )
    parser.set_defaults(func=run_check_launch)


def memory_cap_line(cfg: DFLOPConfig, plan: Any) -> str:
    """The memory cap the launch will take, as far as it is known before the devices are: the
    config's number, the plan's, none, or each device's default (decided at launch)."""
    cap = cfg.sampler.memory_cap_bytes
    if cfg.sampler.kind != "dflop":
        return RunMemoryCap(None, "not the dflop sampler").describe()
    if cap == OFF:
        return RunMemoryCap(None, "dflop.sampler.memory_cap_bytes = off").describe()
    if cap == AUTO:
        return "memory cap: each device's default from its free memory, the smallest over all ranks (decided at launch)"
    source = "plan" if plan is not None and plan.memory_cap_bytes == cap else "config"
    return RunMemoryCap(float(cap), source).describe()


def check_launch(args: argparse.Namespace) -> list[str]:
    """Check the launch ``args`` describe; the lines of its report (raises
    :class:`~dflop_ds.setup_checks.SetupError` or another ``ValueError`` naming the fault)."""
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise SetupError(f"--nodes and --gpus-per-node must be >= 1, got {args.nodes} and {args.gpus_per_node}")
    world = args.nodes * args.gpus_per_node
    where = f"{args.nodes} node(s) x {args.gpus_per_node} GPU(s) = world size {world}"
    from dflop_ds.compose import model_source, print_skip_report  # the model's code: not at parser build

    # the launch's devices are not this machine's; the plan file is read once
    ds_config, cfg, plan = load_run_settings(args, check_device=False)
    try:  # the config alone first: a refusal costs no model loading
        check_training_setup(ds_config, cfg, world, plan=plan)
        source = model_source(cfg)
        data = source.read_shapes(cfg.data.path, cfg.data.on_bad_sample)
        print_skip_report(data.report)
        shapes = data[: cfg.data.max_samples]
        check_training_setup(ds_config, cfg, world, plan=plan, n_samples=len(shapes), n_layers=source.n_layers)
        if cfg.sampler.cost_model not in (None, PROXY):
            cost_model = load_cost_model(cfg.sampler.cost_model)
            check_cost_model_fits(
                cost_model,
                source.policy,
                encoder_layers=len(source.encoder_layers),
                llm_layers=len(source.llm_layers),
                source=str(cfg.sampler.cost_model),
            )
    except SetupError as error:
        raise SetupError(f"for {where}: {error}") from None
    stages, tp = cfg.plan.pipeline_stages, deepspeed_keys(ds_config).autotp_size
    total, micro, gas = resolve_batch_keys(ds_config, world // stages)
    lines = [
        f"launch: {where}",
        f"model: {source.name}, {source.n_layers} layers; pipeline_stages {stages}, autotp_size {tp},"
        f" data-parallel {world // stages // tp}",
        f"batch: train_batch_size {total} = micro {micro} x GAS {gas} x dp {world // stages}"
        + (f" (tensor-parallel peers share their samples: {total // tp} distinct per step)" if tp > 1 else ""),
        f"data: {len(shapes)} samples of {cfg.data.path}, {len(shapes) // (total // tp)} global batches per epoch",
        "cost model: "
        + (
            f"{cfg.sampler.cost_model} (made for this model)"
            if cfg.sampler.cost_model not in (None, PROXY)
            else "resolved on rank 0 at launch (profile cache or proxy) and broadcast to every rank"
        ),
        memory_cap_line(cfg, plan),
        f"sync: {sync_model_of(ds_config, stages).describe()}",
    ]
    if plan is not None:
        lines.append(f"plan: {cfg.plan.file}, made for {plan.world_size()} GPUs, {plan.gpus_per_node} per node")
        if plan.gpus_per_node != args.gpus_per_node:
            lines.append(
                f"note: the plan assumed {plan.gpus_per_node} GPUs per node, this launch has {args.gpus_per_node}:"
                " its predicted times assumed other links between the GPUs (re-plan for the real node shape)"
            )
    if tp > args.gpus_per_node:
        lines.append(
            f"note: autotp_size {tp} spans nodes ({args.gpus_per_node} GPUs per node): every layer crosses them"
        )
    return lines


def run_check_launch(args: argparse.Namespace) -> int:
    """``dflop-ds check-launch``: print the report; 0 when the launch is consistent."""
    for line in check_launch(args):
        print(line)
    print(f"check-launch: OK for {args.nodes} node(s) x {args.gpus_per_node} GPU(s)")
    return 0
