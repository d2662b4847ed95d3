"""``dflop-ds profile model | data | engine | report``: profile a model and a dataset, inspect the fits."""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable
from typing import Any

from dflop_ds.commands.arg_types import int_at_least, positive_int_list
from dflop_ds.commands.data import add_read_arguments, policy_from_args, read_options
from dflop_ds.cost import FittedCostModel, LayeredCostModel, check_policy, load_cost_model, save_cost_model
from dflop_ds.data import read_dataset
from dflop_ds.models.hf.profile import hf_target
from dflop_ds.models.tiny import TinyMLLMConfig
from dflop_ds.models.tiny_profile import tiny_target
from dflop_ds.paths import check_writable
from dflop_ds.plan.engine_profile import engine_profile_from_run
from dflop_ds.profile.data import DataProfile, profile_data
from dflop_ds.profile.model import DEFAULT_BATCH_SIZES, DEFAULT_SEQ_LENS, DEFAULT_TILES, PROTOCOLS, profile_model
from dflop_ds.profile.report import cost_model_table, data_profile_table, plot_report
from dflop_ds.profile.timing import CLOCKS, STATISTICS

positive_int, non_negative_int = int_at_least(1), int_at_least(0)


def load_target(spec: str) -> Any:
    """Call ``module:function`` and return its :class:`~dflop_ds.profile.target.ProfileTarget`."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--target must look like 'package.module:function', got {spec!r}")
    factory: Callable[[], Any] = getattr(importlib.import_module(module_name), attr)
    return factory()


def run_model(args: argparse.Namespace) -> int:
    """``profile model``: profile, fit and save a FittedCostModel (measurements included)."""
    if args.target and args.model_name_or_path:
        raise SystemExit("profile model: give --target or --model_name_or_path, not both")
    check_writable(args.output, "--output")  # fail now, not after profiling
    if args.target:
        target = load_target(args.target)
    elif args.model_name_or_path:
        target = hf_target(args.model_name_or_path)  # a folder lacking weights or tokenizer is named first
    else:
        config = TinyMLLMConfig(vision_layers=args.vision_layers, llm_layers=args.llm_layers)
        target = tiny_target(config, seed=args.seed)
    started = time.perf_counter()
    profile = profile_model(
        **target.profile_kwargs(),
        tiles=args.tiles,
        seq_lens=args.seq_lens,
        batch_sizes=args.batch_sizes,
        max_blocks=args.max_blocks,
        warmup=args.warmup,
        repeats=args.repeats,
        statistic=args.statistic,
        clock=args.clock,
        threads=args.threads,
        progress=not args.no_progress,
        seed=args.seed,
        protocol=args.protocol,
        calibrate=not args.no_calibrate,
    )
    model = FittedCostModel().fit(profile, getattr(target, "policy", None))
    save_cost_model(model, args.output)
    for note in profile.meta["scaling"]:
        print(note)
    print(
        f"profiled {len(profile.encoder)} encoder and {len(profile.llm)} LLM shapes in "
        f"{time.perf_counter() - started:.1f} s ({profile.meta['clock']} clock); wrote {args.output}"
    )
    return 0


def run_data(args: argparse.Namespace) -> int:
    """``profile data``: sample a dataset's shapes and save a DataProfile."""
    check_writable(args.output, "--output")
    started = time.perf_counter()
    profile = profile_data(
        args.data,
        policy_from_args(args),
        samples=args.samples,
        seed=args.seed,
        bins=args.bins,
        on_bad_sample=args.on_bad_sample,
        **read_options(args),
    )
    profile.save(args.output)
    print(data_profile_table(profile))
    print(f"profiled in {time.perf_counter() - started:.1f} s; wrote {args.output}")
    return 0


def run_engine(args: argparse.Namespace) -> int:
    """``profile engine``: fit an EngineProfile from a profiling run's telemetry and save it."""
    check_writable(args.output, "--output")
    policy = policy_from_args(args)
    cost_model = load_cost_model(args.cost_model)
    if not isinstance(cost_model, LayeredCostModel):
        raise ValueError(
            f"{args.cost_model}: a {type(cost_model).__name__} records no layer depths, so the run's stage"
            " split cannot be read as shares of its predictions; give a profiled model (dflop-ds profile model)"
        )
    check_policy(cost_model, policy, source=args.cost_model)
    shapes = read_dataset(args.data, policy, **read_options(args))
    profile = engine_profile_from_run(args.telemetry, shapes, cost_model, skip_steps=args.skip_steps)
    profile.save(args.output)
    print(
        f"engine profile from {profile.meta['steps']} steps of {args.telemetry} (stage split "
        f"{profile.meta['stage_bounds']}):"
    )
    print(
        f"  compute inside the engine: encoder x{profile.compute_scale[0]:.3f}, llm x{profile.compute_scale[1]:.3f} "
        f"of the profiled cost model; forward share {profile.forward_fraction:.3f}"
    )
    print("  load per microbatch (ms): " + ", ".join(f"{x * 1e3:.2f}" for x in profile.load_s))
    print("  step tail, reduce + optimizer (ms): " + ", ".join(f"{x * 1e3:.2f}" for x in profile.tail_s))
    print(f"  one blocking exchange: {profile.exchange_s * 1e3:.3f} ms")
    print(
        f"  check on the profiled steps: simulated mean step {profile.meta['simulated_mean_step_s']:.3f} s, "
        f"measured {profile.meta['measured_mean_step_s']:.3f} s"
    )
    print(f"wrote {args.output}")
    return 0


def run_report(args: argparse.Namespace) -> int:
    """``profile report``: print the fit tables and write a PNG of the curves."""
    model = load_cost_model(args.cost_model)
    if not isinstance(model, FittedCostModel):
        raise ValueError(f"{args.cost_model}: a {type(model).__name__} has no fits to report; pass a profiled one")
    data = DataProfile.load(args.data_profile) if args.data_profile else None
    if args.png:
        check_writable(args.png, "--png")
    print(cost_model_table(model))
    if data is not None:
        print()
        print(data_profile_table(data))
    if args.png:
        plot_report(model, args.png, data)
        print(f"wrote {args.png}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``profile model``, ``profile data``, ``profile engine`` and ``profile report``."""
    profile = subparsers.add_parser(
        "profile",
        help="profile a model or a dataset; report a cost model",
        description="Model profiler, data profiler and cost-model report.",
    )
    commands = profile.add_subparsers(dest="profile_command", metavar="WHAT")
    profile.set_defaults(func=lambda args: (profile.print_help(), 2)[1])

    model = commands.add_parser(
        "model",
        help="time forward+backward of the model's layers; fit and save a FittedCostModel",
        description="Profile the bundled tiny MLLM (or a HuggingFace LLaVA directory, or --target) over tile "
        "counts and (batch, sequence length) grids, a few blocks scaled to the full depth, and "
        "save the fitted FittedCostModel.",
    )
    model.add_argument(
        "--target",
        default=None,
        metavar="MODULE:FUNC",
        help="a function returning a dflop_ds.profile.ProfileTarget (your own layers)",
    )
    model.add_argument(
        "--model_name_or_path",
        "--model-name-or-path",
        dest="model_name_or_path",
        metavar="DIR",
        help="a HuggingFace LLaVA save_pretrained directory: profile its real vision tower "
        "(per image count) and decoder layers (per sequence length)",
    )
    model.add_argument("--vision-layers", type=positive_int, default=4, help="tiny model: vision blocks (default 4)")
    model.add_argument("--llm-layers", type=positive_int, default=4, help="tiny model: decoder blocks (default 4)")
    model.add_argument(
        "--max-blocks", type=positive_int, default=2, help="identical blocks profiled per segment (default 2)"
    )
    model.add_argument("--tiles", type=positive_int_list, default=list(DEFAULT_TILES), help="encoder tile counts")
    model.add_argument(
        "--seq-lens", type=positive_int_list, default=list(DEFAULT_SEQ_LENS), help="LLM sequence lengths"
    )
    model.add_argument(
        "--batch-sizes", type=positive_int_list, default=list(DEFAULT_BATCH_SIZES), help="LLM batch sizes"
    )
    model.add_argument("--warmup", type=non_negative_int, default=1, help="untimed rounds (default 1)")
    model.add_argument("--repeats", type=positive_int, default=5, help="timed rounds (default 5)")
    model.add_argument("--statistic", choices=STATISTICS, default="min", help="summary of the repeats")
    model.add_argument(
        "--clock",
        choices=CLOCKS,
        default="auto",
        help="auto: process CPU time on a CPU device, wall time on an accelerator",
    )
    model.add_argument("--threads", type=positive_int, default=1, help="torch threads while profiling (default 1)")
    model.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="chain",
        help="chain: the profiled layers of one size in one connected pass (default); layer: each on its own",
    )
    model.add_argument(
        "--no-calibrate", action="store_true", help="skip scaling each segment by its measured full-depth time"
    )
    model.add_argument("--seed", type=int, default=0)
    model.add_argument("--no-progress", action="store_true", help="no progress bar")
    model.add_argument("--output", "-o", default="costmodel.json", help="output JSON (default costmodel.json)")
    model.set_defaults(func=run_model)

    data = commands.add_parser(
        "data",
        help="sample a dataset's shapes and save a DataProfile",
        description="Read a shape manifest or LLaVA file, sample shapes (seeded) and save their "
        "distribution (statistics, histograms and the sampled shapes).",
    )
    data.add_argument("data", metavar="DATA", help="shape manifest (JSONL) or LLaVA JSON/JSONL file")
    add_read_arguments(data, default_policy="tiny")
    data.add_argument("--samples", type=positive_int, default=2000, help="samples to draw (default 2000; all if fewer)")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--bins", type=positive_int, default=20, help="histogram bins (default 20)")
    data.add_argument("--on-bad-sample", choices=("error", "skip"), default="error")
    data.add_argument("--output", "-o", default="dataprofile.json", help="output JSON (default dataprofile.json)")
    data.set_defaults(func=run_data)

    engine = commands.add_parser(
        "engine",
        help="fit the engine's own costs from a short training run's telemetry",
        description="Fit an EngineProfile (in-engine compute multipliers, microbatch load, the step's "
        "reduce+optimizer tail, the cost of a blocking exchange) from the telemetry JSONL of a "
        "few steps of DeepSpeed pipeline training, so the simulator predicts other runs.",
    )
    engine.add_argument("telemetry", metavar="TELEMETRY", help="telemetry JSONL written by RuntimeTracker (rank 0)")
    engine.add_argument("--cost-model", required=True, help="the cost-model JSON of `dflop-ds profile model`")
    engine.add_argument("--data", required=True, help="the run's dataset (shape manifest or LLaVA file)")
    add_read_arguments(engine, default_policy="tiny")
    engine.add_argument("--skip-steps", type=non_negative_int, default=3, help="warm-up steps to leave out (default 3)")
    engine.add_argument("--output", "-o", default="engine_profile.json", help="output JSON")
    engine.set_defaults(func=run_engine)

    report = commands.add_parser(
        "report",
        help="print a cost model's fit against its measurements; plot it",
        description="Print the measurements next to the fitted predictions and write a PNG of the curves.",
    )
    report.add_argument("cost_model", metavar="COSTMODEL", help="JSON written by `dflop-ds profile model`")
    report.add_argument("--data-profile", default=None, metavar="JSON", help="also summarize this DataProfile")
    report.add_argument("--png", default="costmodel.png", help="PNG to write (default costmodel.png; '' for none)")
    report.set_defaults(func=run_report)
