"""dflop_ds.plan: 1F1B pipeline simulator, parallelism search, plans (reference cost models: dflop_ds.cost)."""

from dflop_ds.plan.cluster import Cluster
from dflop_ds.plan.engine_profile import EngineProfile, engine_profile_from_run
from dflop_ds.plan.instructions import Instruction, format_schedule, stage_order, train_schedule
from dflop_ds.plan.layout import Layout, Segment
from dflop_ds.plan.plan_file import PLAN_FORMAT_VERSION, Plan, PlanFileError
from dflop_ds.plan.planner import PlanSet, make_plans, simulate_layout
from dflop_ds.plan.search import PlanError, Scored, SearchResult, search
from dflop_ds.plan.simulator import SimResult, simulate_1f1b, simulate_stage_times

__all__ = [
    "Cluster",
    "EngineProfile",
    "Instruction",
    "Layout",
    "PLAN_FORMAT_VERSION",
    "Plan",
    "PlanError",
    "PlanFileError",
    "PlanSet",
    "Scored",
    "SearchResult",
    "Segment",
    "SimResult",
    "engine_profile_from_run",
    "format_schedule",
    "make_plans",
    "search",
    "simulate_1f1b",
    "simulate_layout",
    "simulate_stage_times",
    "stage_order",
    "train_schedule",
]
