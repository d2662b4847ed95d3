"""dflop_ds.plan: 1F1B pipeline simulator, parallelism search, plans, analytic reference profiles."""

from dflop_ds.plan.cluster import Cluster
from dflop_ds.plan.instructions import Instruction, format_schedule, stage_order, train_schedule
from dflop_ds.plan.layout import Layout, Segment
from dflop_ds.plan.plan_file import PLAN_FORMAT_VERSION, Plan, PlanFileError
from dflop_ds.plan.planner import PlanSet, load_cost_model, make_plans, simulate_layout
from dflop_ds.plan.reference import AnalyticMLLM, reference_model, reference_names
from dflop_ds.plan.search import PlanError, Scored, SearchResult, search
from dflop_ds.plan.simulator import SimResult, simulate_1f1b, simulate_stage_times

__all__ = [
    "AnalyticMLLM", "Cluster", "Instruction", "Layout", "PLAN_FORMAT_VERSION", "Plan", "PlanError", "PlanFileError",
    "PlanSet", "Scored", "SearchResult", "Segment", "SimResult", "format_schedule", "load_cost_model",
    "make_plans", "reference_model", "reference_names", "search", "simulate_1f1b", "simulate_layout",
    "simulate_stage_times", "stage_order", "train_schedule",
]
