"""The plans the planner chooses on the ``bench-plan`` grid, as JSON, to compare two versions of the planner.

For every reference profile and GPU count of :mod:`benchmarks.bench_plan` (global batch, data and
cluster as there), both searches the bench runs (the full one and ``max_tp=1``) and each plan they
choose (best overall, best shared pipeline, monolithic baseline, best colocated): the family, the
layout, the stage bounds over the flat layer list and the predicted step seconds; plus each
search's wall seconds. ``--compare OLD.json`` prints the grid points whose choices differ.

Run: ``.venv/bin/python benchmarks/plan_choices.py --out before.json [--gpus 8 64]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_plan import GLOBAL_BATCH  # noqa: E402  (the bench's grid)
from dflop_ds.cost import reference_model, reference_names  # noqa: E402
from dflop_ds.data import read_manifest  # noqa: E402
from dflop_ds.plan import Cluster, PlanError, make_plans  # noqa: E402
from dflop_ds.plan.layout import flat_bounds  # noqa: E402
from dflop_ds.plan.search import Scored  # noqa: E402
from dflop_ds.shapes import ShapePolicy  # noqa: E402

ROLES = ("best", "best_deepspeed", "monolithic", "colocated")


def global_batch(gpus: int) -> int:
    """The bench's global batch for ``gpus`` (2 samples per GPU off its table)."""
    return GLOBAL_BATCH.get(gpus, 2 * gpus)


def describe_choice(scored: Scored | None) -> dict[str, Any] | None:
    """Family, layout, stage bounds and predicted step of one chosen plan (None stays None)."""
    if scored is None:
        return None
    return {
        "family": scored.family,
        "layout": scored.layout.describe(),
        "splitter": scored.layout.splitter,
        "stage_bounds": flat_bounds(scored.layout.stages).to_list(),
        "step_time_s": scored.step_time,
    }


def grid_point(model: Any, gpus: int, shapes: list, max_tp: int | None, n_batches: int = 3) -> dict[str, Any]:
    """The choices of one search at one grid point (``{"error": ...}`` when nothing fits)."""
    cluster = Cluster(gpus=gpus, gpu_memory_bytes=model.gpu.memory_bytes)
    if max_tp is not None:
        cluster = replace(cluster, max_tp=max_tp)
    start = time.perf_counter()
    try:
        plans = make_plans(model, cluster, shapes, global_batch(gpus), n_batches=n_batches)
    except PlanError as error:
        return {"error": str(error)}
    result = plans.result
    chosen = (result.best, result.best_deepspeed, result.monolithic, result.best_colocated)
    out: dict[str, Any] = {role: describe_choice(s) for role, s in zip(ROLES, chosen)}
    out["search_s"] = time.perf_counter() - start
    return out


def grid_choices(profiles: list[str], gpus: list[int], data: str, n_batches: int = 3) -> dict[str, Any]:
    """``{"<profile>@<gpus>/<search>": choices}`` over the grid (searches ``full`` and ``tp1``)."""
    shapes = list(read_manifest(data, ShapePolicy()))
    out: dict[str, Any] = {}
    for name in profiles:
        model = reference_model(name)
        for g in gpus:
            for search, max_tp in (("full", None), ("tp1", 1)):
                out[f"{name}@{g}/{search}"] = point = grid_point(model, g, shapes, max_tp, n_batches)
                print(f"{name}@{g}/{search}: {point.get('search_s', 0.0):.2f} s", file=sys.stderr, flush=True)
    return out


def paired_choices(old: dict[str, Any], new: dict[str, Any]) -> Iterator[tuple[str, str, Any, Any]]:
    """``(grid point, role, old choice, new choice)`` of every role at the grid points both hold."""
    for key in sorted(set(old) & set(new)):
        for role in ROLES:
            yield key, role, old[key].get(role), new[key].get(role)


def same_layout(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two chosen plans have the same family, layout, splitter and stage bounds."""
    return all(a[f] == b[f] for f in ("family", "layout", "splitter", "stage_bounds"))


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per grid point and role whose family, layout or stage bounds differ, or whose
    predicted step differs by more than 1e-9 relative."""
    lines = []
    for key, role, a, b in paired_choices(old, new):
        if a is None or b is None:
            if a != b:
                lines.append(f"{key} {role}: {a} -> {b}")
            continue
        close = abs(a["step_time_s"] - b["step_time_s"]) <= 1e-9 * abs(a["step_time_s"])
        if not (same_layout(a, b) and close):
            lines.append(
                f"{key} {role}: {a['layout']} {a['stage_bounds']} {a['step_time_s']:.6f} s -> "
                f"{b['layout']} {b['stage_bounds']} {b['step_time_s']:.6f} s"
            )
    return lines


def summary(old: dict[str, Any], new: dict[str, Any]) -> str:
    """One line: how many chosen plans changed family, layout or stage bounds, and how far the
    predicted steps of the unchanged ones moved (relative, new over old)."""
    changed, moved = 0, []
    for _, _, a, b in paired_choices(old, new):
        if a is None or b is None:
            changed += a != b
        elif same_layout(a, b):
            moved.append(b["step_time_s"] / a["step_time_s"] - 1.0)
        else:
            changed += 1
    spread = f"{min(moved):+.2%} to {max(moved):+.2%}" if moved else "none"
    return f"plans: {changed} changed layout, {len(moved)} the same (their predicted steps moved {spread})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT / "examples/data/mixture.jsonl"))
    parser.add_argument("--gpus", type=int, nargs="+", default=sorted(GLOBAL_BATCH))
    parser.add_argument("--profiles", nargs="+", default=reference_names("llava-ov"))
    parser.add_argument("--out", help="write the choices here (JSON)")
    parser.add_argument("--compare", help="a JSON file of earlier choices: print what differs")
    args = parser.parse_args()
    choices = grid_choices(args.profiles, args.gpus, args.data)
    if args.out:
        Path(args.out).write_text(json.dumps(choices, indent=1, sort_keys=True) + "\n")
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        lines = differences(before, choices)
        print("\n".join(lines) if lines else "same choices at every grid point")
        print(summary(before, choices))
    return 0


if __name__ == "__main__":
    sys.exit(main())
