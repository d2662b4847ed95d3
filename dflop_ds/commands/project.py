"""``dflop-ds project``: what each sampler would gain on your data from 8 to thousands of GPUs (a prediction).

    dflop-ds project --cost-model llava-ov-7b-h100 --data data.jsonl --gpus 8 64 512 --png gain.png

For every cluster size it prints the predicted step time and samples/s of stock, LLaVA's modality
grouping, verl, transformers' ``batch_rebalance``, stock + packing, LLaMA-Factory's and ms-swift's
packing and DFLOP (dflop-ds), each on
the best plan the planner finds for it (:mod:`dflop_ds.plan.projection`), DFLOP's gain over the
best of them with its range over the sampled global batches, the cost model used and the
simulator's last measured error against real runs (:mod:`dflop_ds.plan.calibration`).
``--zero-stage`` sets the memory model and how ranks meet in a single-stage step (the sync
model, :meth:`~dflop_ds.plan.cluster.Cluster.sync_model`), under which every method is scored.
``--max-tp`` and ``--microbatches`` restrict every method's plan alike, e.g. to the layout ZeRO-3
users run (``--zero-stage 3 --max-tp 1 --microbatches 4``: data parallelism over all GPUs, the
gradient accumulation of their DeepSpeed config).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dflop_ds.commands.arg_types import MAX_PLANNED_GPUS, int_at_least, int_in_range
from dflop_ds.commands.plan import (
    _common,
    _read_shapes,
    add_cluster_options,
    gpu_memory_bytes,
    load_planner_model,
    repeat_note,
    tensor_parallel_layers,
    training_precision,
)
from dflop_ds.cost import PlannerCostModel
from dflop_ds.paths import check_writable
from dflop_ds.plan.calibration import load_calibration
from dflop_ds.plan.cluster import Cluster
from dflop_ds.plan.planner import describe_cost_model
from dflop_ds.plan.projection import SizeProjection, encoder_share, project, table_lines
from dflop_ds.shapes import SampleShape


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``project`` to the ``dflop-ds`` command."""
    parser = subparsers.add_parser(
        "project",
        help="predict each sampler's step time and DFLOP's gain on a data set at several cluster sizes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--gpus",
        type=int_in_range(1, MAX_PLANNED_GPUS, "the largest cluster the planner is measured at"),
        nargs="+",
        required=True,
        help=f"cluster sizes (GPUs) to project, at most {MAX_PLANNED_GPUS}",
    )
    parser.add_argument("--batch-per-gpu", type=int, default=2, help="global batch = this x GPUs (default 2)")
    add_cluster_options(parser)
    parser.add_argument(
        "--microbatches",
        type=int_at_least(1),
        default=None,
        help="microbatches per GPU and step (gradient accumulation) of every method's plan (default: each"
        " method's best count)",
    )
    parser.add_argument("--batches", type=int, default=3, help="sampled global batches per plan (the spread)")
    parser.add_argument(
        "--calibration",
        default=None,
        help="simulator calibration JSON (default: out/simulator_calibration.json, else the figures in docs)",
    )
    parser.add_argument("--png", default=None, help="also draw DFLOP's gain against the GPU count into this PNG")
    _common(parser)
    parser.set_defaults(func=run_project)


def run_project(args: argparse.Namespace) -> int:
    """``dflop-ds project``: print the projection table, the cost model and the simulator's error."""
    if args.png is not None:
        check_writable(args.png, "project --png")
    if min(args.gpus) < 1 or args.batch_per_gpu < 1 or args.batches < 1:
        raise ValueError("--gpus, --batch-per-gpu and --batches must be positive")
    calibration = load_calibration(args.calibration)
    model = load_planner_model(args.cost_model)
    shapes = _read_shapes(args, model)
    cluster = Cluster(
        gpus=1,
        gpus_per_node=args.gpus_per_node,
        gpu_memory_bytes=gpu_memory_bytes(args, model),
        zero_stage=args.zero_stage,
        precision=training_precision(args, model),
        autotp=args.model_name_or_path is not None,
        max_tp=args.max_tp,
    )
    fixed = {} if args.microbatches is None else {"nmb_choices": (args.microbatches,)}
    if len(shapes) < 2:
        raise ValueError(
            f"project: {args.data} has {len(shapes)} sample(s): global batches drawn from it would repeat one"
            " sample, with nothing to balance; give a data set of the mix you train on"
        )
    sizes = []
    for done, gpus in enumerate(args.gpus):  # a large cluster's search takes seconds: say where it is
        print(f"[{done + 1}/{len(args.gpus)}] planning {gpus} GPUs ...", file=sys.stderr, flush=True)
        sizes += project(
            model,
            shapes,
            [gpus],
            batch_per_gpu=args.batch_per_gpu,
            cluster=cluster,
            n_batches=args.batches,
            seed=args.seed,
            tensor_parallel_layers=tensor_parallel_layers(args, model),
            **fixed,
        )
    for line in header_lines(model, args.cost_model, args.data, shapes, args.batch_per_gpu, args.batches, cluster):
        print(line)
    if args.max_tp is not None or args.microbatches is not None:
        tp = "default" if args.max_tp is None else f"at most {args.max_tp}"
        print(
            f"every method's plan restricted alike: tensor parallelism {tp},"
            f" {args.microbatches or 'any number of'} microbatches per GPU"
        )
    note = repeat_note(args.batch_per_gpu * max(args.gpus), shapes)
    if note is not None:
        print(note)
    print(calibration.describe())
    for line in table_lines(sizes):
        print(line)
    if args.png is not None:
        plot_gains(sizes, args.png, describe_cost_model(model)["name"])
        print(f"wrote {args.png}")
    return 0


def header_lines(
    model: PlannerCostModel,
    spec: str,
    data: str,
    shapes: Sequence[SampleShape],
    batch_per_gpu: int,
    batches: int,
    cluster: Cluster,
) -> list[str]:
    """What the projection is (a prediction), the cost model it used (``spec``: its file or
    reference name), and the data and cluster."""
    described = describe_cost_model(model)
    name = spec if spec.lower() == described["name"] else f"{spec} ({described['name']})"
    return [
        f"PREDICTION, not a measurement: cost model {name} ({described['note']}), 1F1B simulator",
        f"data: {data}: {len(shapes)} samples, encoder {encoder_share(model, shapes):.1%} of the work; global batch"
        f" {batch_per_gpu} x GPUs, {batches} sampled global batches per plan; {cluster.gpus_per_node} GPUs per node,"
        f" {cluster.gpu_memory_bytes / 1e9:.0f} GB each, ZeRO-{cluster.zero_stage}, {cluster.precision}",
        f"sync model (ZeRO-{cluster.zero_stage}, one stage; every method scored under it; pipelines 1F1B):"
        f" {cluster.sync_model().describe()}",
    ]


def plot_gains(sizes: Sequence[SizeProjection], path: str, cost_model: str) -> None:
    """Draw DFLOP's predicted gain over the best baseline against the GPU count, with its range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [s.gpus for s in sizes]
    gains = [s.gain for s in sizes]
    low = [s.gain - s.gain_range[0] for s in sizes]
    high = [s.gain_range[1] - s.gain for s in sizes]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.errorbar(gpus, gains, yerr=[low, high], marker="o", capsize=4)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("DFLOP step speed-up over the best baseline")
    ax.set_title(f"predicted, not measured ({cost_model})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
