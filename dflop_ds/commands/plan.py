"""``dflop-ds plan`` and ``dflop-ds simulate``: search a parallelism plan, draw its Gantt chart."""

from __future__ import annotations

import argparse
from typing import Any

from dflop_ds.commands.arg_types import MAX_PLANNED_GPUS, int_at_least, int_in_range, positive_float
from dflop_ds.commands.data import add_read_arguments, policy_from_args, read_options
from dflop_ds.config import plan_deepspeed_config, plan_reference, set_settings
from dflop_ds.cost import PlannerCostModel, check_policy, load_cost_model, reference_names
from dflop_ds.data import read_dataset
from dflop_ds.jsonio import write_json
from dflop_ds.paths import check_writable
from dflop_ds.plan.cluster import DEFAULT_GPU_MEMORY_BYTES, PRECISIONS, ZERO_SHARDED, Cluster
from dflop_ds.plan.gantt import plot_gantt
from dflop_ds.plan.plan_file import Plan
from dflop_ds.plan.planner import cluster_of, has_tensor_parallel_layers, make_plans, simulate_layout
from dflop_ds.plan.search import PlanError
from dflop_ds.shapes import SampleShape


def load_planner_model(spec: str) -> PlannerCostModel:
    """The cost model ``spec`` names (a file or a reference name), refused unless the planner can
    search with it (a :class:`~dflop_ds.cost.PlannerCostModel`: a profiled or reference model)."""
    model = load_cost_model(spec)
    if not isinstance(model, PlannerCostModel):
        raise ValueError(
            f"{spec}: a {type(model).__name__} cannot be planned with (it records no layer depths or"
            " parameter bytes); give a profiled model (dflop-ds profile model) or a reference name"
        )
    return model


def _read_shapes(args: argparse.Namespace, model: PlannerCostModel) -> list:
    """The shapes of ``args.data`` under the flags' policy, after checking ``model`` was made for it."""
    policy = policy_from_args(args)
    if not model.is_analytic:
        check_policy(model, policy, source=args.cost_model)
    shapes = list(read_dataset(args.data, policy, **read_options(args)))
    if not shapes:
        raise ValueError(f"{args.data}: no samples")
    return shapes


def repeat_note(global_batch: int, shapes: list[SampleShape]) -> str | None:
    """A note when global batches of ``global_batch`` samples are drawn from fewer ``shapes``
    (samples repeat within a batch); None when the data set is large enough."""
    if global_batch <= len(shapes):
        return None
    return (
        f"note: a global batch of up to {global_batch} samples is drawn from {len(shapes)}: samples repeat within it,"
        " so the figures reflect this data set's mix, not its size"
    )


def add_cluster_options(parser: argparse.ArgumentParser) -> None:
    """The cluster options ``plan`` and ``project`` share: GPUs per node, GPU memory, the largest
    tensor-parallel degree, the ZeRO stage and the training precision."""
    parser.add_argument(
        "--gpus-per-node", type=int_at_least(1), default=8, help="GPUs per node (tensor parallelism stays inside)"
    )
    parser.add_argument(
        "--gpu-memory-gb",
        type=positive_float,
        default=None,
        help="memory per GPU in GB (default: the profile's GPU, else 80)",
    )
    parser.add_argument(
        "--max-tp",
        type=int_at_least(1),
        default=None,
        help="largest tensor-parallel degree (default: --gpus-per-node for a model with tensor-parallel"
        " layers, else 1; more than 1 for a model without them is refused); 1 for the pure data"
        " parallelism ZeRO-3 users run",
    )
    parser.add_argument(
        "--zero-stage",
        type=int,
        default=1,
        choices=sorted(ZERO_SHARDED),
        help="DeepSpeed ZeRO stage: what is sharded and how data-parallel ranks meet (0, 1: once a step;"
        " 2: every microbatch; 3: every module); 2 and 3 only without pipeline stages",
    )
    parser.add_argument(
        "--precision",
        default=None,
        choices=PRECISIONS,
        help="training precision the memory model assumes (default: bf16 for an analytic cost model,"
        " fp32 for a measured one)",
    )


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cost-model",
        required=True,
        help=f"a cost-model JSON file or a reference profile: {', '.join(reference_names())}",
    )
    parser.add_argument(
        "--data", required=True, help="dataset to draw global batches from (shape manifest or LLaVA JSON/JSONL)"
    )
    add_read_arguments(parser)
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the sampled global batches")


def _summary(tag: str, plan: Plan) -> str:
    p = plan.predicted
    mem = max(p.get("peak_memory_bytes", [0.0])) / 1e9
    ds = "yes" if plan.deepspeed_compatible else "no (separate GPU sets)"
    speedup = p["speedup_vs_monolithic"]
    vs = "no monolithic layout fits" if speedup is None else f"x{speedup:.3f} vs monolithic"
    cap = "" if plan.memory_cap_bytes is None else f"  activations <= {plan.memory_cap_bytes / 1e9:.1f} GB/GPU"
    return (
        f"{tag:<11} {plan.layout.describe():<48} step {p['step_time_s']:.4g} s  "
        f"bubble {p['bubble_fraction']:.1%}  peak {mem:.1f} GB{cap}  {vs}  stock DeepSpeed: {ds}"
    )


def hf_model_has_tp_plan(model_name_or_path: str) -> bool:
    """Whether the HuggingFace model saved at ``model_name_or_path`` declares a tensor-parallel plan
    for its language model (what DeepSpeed AutoTP shards; read from its config, no weights loaded)
    and its model family runs under AutoTP (:attr:`~dflop_ds.models.hf.registry.ModelFamily.tensor_parallel`)."""
    from transformers import AutoConfig

    from dflop_ds.models.hf.registry import family_of

    if not family_of(model_name_or_path).tensor_parallel:
        return False
    config = AutoConfig.from_pretrained(model_name_or_path)
    plans = (getattr(c, "base_model_tp_plan", None) for c in (config, config.get_text_config()))
    return any(bool(plan) for plan in plans)


def tensor_parallel_layers(args: argparse.Namespace, model: PlannerCostModel) -> bool:
    """Whether the model to train has tensor-parallel layers: a HuggingFace model's config says
    (``--model_name_or_path``), else the cost model does (the bundled tiny model has none)."""
    if args.model_name_or_path is not None:
        return hf_model_has_tp_plan(args.model_name_or_path)
    return has_tensor_parallel_layers(model)


def gpu_memory_bytes(args: argparse.Namespace, model: PlannerCostModel) -> float:
    """``--gpu-memory-gb`` in bytes, else the cost model's GPU memory, else
    :data:`~dflop_ds.plan.cluster.DEFAULT_GPU_MEMORY_BYTES`."""
    return args.gpu_memory_gb * 1e9 if args.gpu_memory_gb else model.gpu_memory_bytes or DEFAULT_GPU_MEMORY_BYTES


def training_precision(args: argparse.Namespace, model: PlannerCostModel) -> str:
    """``--precision``, by default ``bf16`` for an analytic cost model (it counts bf16 bytes) and
    ``fp32`` for a measured one (profiled in fp32 here).

    Raises:
        PlanError: a 16-bit precision for the bundled tiny model, which trains in fp32 only.
    """
    analytic = bool(model.is_analytic)
    precision = args.precision or ("bf16" if analytic else "fp32")
    if precision != "fp32" and not analytic and args.model_name_or_path is None:
        raise PlanError(
            f"--precision {precision}: the bundled tiny model trains in fp32 only (its inputs and"
            " loss are fp32); plan with --precision fp32"
        )
    return precision


def run_plan(args: argparse.Namespace) -> int:
    """``dflop-ds plan``: search and write the chosen plan."""
    check_writable(args.output, "plan -o")
    if args.deepspeed_config is not None:
        check_writable(args.deepspeed_config, "plan --deepspeed-config")
    model = load_planner_model(args.cost_model)
    cluster = Cluster(
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        gpu_memory_bytes=gpu_memory_bytes(args, model),
        max_tp=args.max_tp,
        zero_stage=args.zero_stage,
        precision=training_precision(args, model),
        autotp=args.model_name_or_path is not None,
    )
    shapes = _read_shapes(args, model)
    note = repeat_note(args.global_batch, shapes)
    if note is not None:
        print(note)
    plans = make_plans(
        model,
        cluster,
        shapes,
        args.global_batch,
        n_batches=args.batches,
        top_k=args.top_k,
        seed=args.seed,
        tensor_parallel_layers=tensor_parallel_layers(args, model),
    )
    r = plans.result
    if model.is_analytic:
        print(
            f"cost model {plans.best.cost_model['name']}: "
            "ANALYTIC (FLOP counts and an assumed throughput), not measured"
        )
    print(
        f"searched {r.n_layouts} layouts, simulated {len(r.candidates)} in {r.seconds:.2f} s "
        f"({args.gpus} GPUs, global batch {args.global_batch}, {args.batches} sampled batches)"
    )
    print(_summary("best", plans.best))
    print(_summary("deepspeed", plans.best_deepspeed))
    if plans.colocated is not None:
        print(_summary("colocated", plans.colocated))
    if plans.monolithic is not None:
        print(_summary("monolithic", plans.monolithic))
    print(f"gap of the best shared-pipeline plan to the best plan: {r.gap:.1%}")
    chosen = plans.best
    chosen.save(args.output)
    print(
        f"wrote {args.output} ({chosen.family} plan, stage bounds {chosen.stage_bounds()}, ZeRO"
        f" {chosen.zero_stage}, {chosen.precision}, activation checkpointing {chosen.activation_checkpointing})"
    )
    if args.deepspeed_config is not None:
        block = set_settings({}, plan=plan_reference(args.output, args.deepspeed_config))
        if args.model_name_or_path is not None:
            set_settings(block, model_name_or_path=args.model_name_or_path)
        write_json(args.deepspeed_config, plan_deepspeed_config(chosen, {"dflop": block}), indent=2)
        print(f"wrote {args.deepspeed_config} (the DeepSpeed config the plan assumed)")
    return 0


def run_simulate(args: argparse.Namespace) -> int:
    """``dflop-ds simulate``: Gantt chart of a plan and of its monolithic baseline on sampled batches."""
    check_writable(args.png, "simulate --png")
    plan = Plan.load(args.plan)
    model = load_planner_model(args.cost_model)
    cluster = cluster_of(plan)
    shapes = _read_shapes(args, model)
    panels: list[tuple[str, Any]] = []
    layouts = [("ours (balanced)", plan.layout)]
    if plan.baseline_layout is not None:
        layouts.append(("monolithic baseline", plan.baseline_layout))
    for title, layout in layouts:
        evals = simulate_layout(
            model, cluster, layout, shapes, plan.global_batch_size, n_batches=args.batches, seed=args.seed
        )
        worst = max(evals, key=lambda e: e.sim.step_time)
        mean = sum(e.sim.step_time for e in evals) / len(evals)
        print(
            f"{title:<20} {layout.describe():<48} mean step {mean:.4g} s over {len(evals)} batch(es), "
            f"bubble {worst.sim.bubble_fraction:.1%}, peak memory {worst.memory.max() / 1e9:.1f} GB"
        )
        panels.append((f"{title} {layout.describe()}", worst.sim))
    if model.is_analytic:
        print("times come from an ANALYTIC cost model (not measured)")
    plot_gantt(panels, args.png)
    print(f"wrote {args.png}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plan`` and ``simulate`` to the ``dflop-ds`` command."""
    p = subparsers.add_parser("plan", help="search encoder/LLM parallelism and microbatching for a cluster and data")
    p.add_argument(
        "--gpus",
        type=int_in_range(1, MAX_PLANNED_GPUS, "the largest cluster the planner is measured at"),
        required=True,
        help=f"GPUs in the job, at most {MAX_PLANNED_GPUS}",
    )
    p.add_argument("--global-batch", type=int_at_least(1), required=True, help="samples per optimizer step")
    add_cluster_options(p)
    p.add_argument(
        "--deepspeed-config",
        default=None,
        help='also write the DeepSpeed config the plan assumed (its "dflop" block points at the plan)',
    )
    p.add_argument("--batches", type=int_at_least(1), default=3, help="sampled global batches per simulated layout")
    p.add_argument("--top-k", type=int_at_least(1), default=6, help="layouts simulated per family")
    p.add_argument("-o", "--output", required=True, help="plan JSON to write")
    _common(p)
    p.set_defaults(func=run_plan)

    s = subparsers.add_parser("simulate", help="draw the Gantt chart of a plan and its monolithic baseline")
    s.add_argument("--plan", required=True, help="plan JSON written by `dflop-ds plan`")
    s.add_argument("--batches", type=int_at_least(1), default=1, help="sampled global batches (the slowest is drawn)")
    s.add_argument("--png", default="plan_gantt.png", help="output PNG")
    _common(s)
    s.set_defaults(func=run_simulate)
