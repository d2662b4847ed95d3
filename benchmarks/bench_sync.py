"""The step of each splitter under each sync model (``boundary``, ``microstep``, ``module``).

The analytic ``llava-ov-7b-h100`` model on the bundled mixture (``examples/data/mixture.jsonl``,
``ShapePolicy()``), its encoder scaled to 10% and 40% of the work (``with_encoder_share``),
4 microbatches of 2 samples per rank, packed (a microbatch costs the sum of its samples), mean
over 3 sampled global batches. Methods: ``stock``, ``verl``, the old lockstep DFLOP (the
partitioner's microbatches on the summed columns, placed by ``lockstep_order``) and ``dflop``
under the row's sync model; ``bound`` is :func:`dflop_ds.sync.step_lower_bound`; ``gap`` is
dflop / bound, ``vs verl`` verl / dflop, ``cpu ms`` the CPU time of one dflop split. The last line
reads ``sync module_gap@64=.. module_gain_vs_verl@64=.. worst_vs_baselines=..`` (40% share).
Run: ``python benchmarks/bench_sync.py``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflop_ds.cost import reference_model  # noqa: E402
from dflop_ds.data import read_manifest  # noqa: E402
from dflop_ds.plan.projection import with_encoder_share  # noqa: E402
from dflop_ds.schedule.partition import partition_batch  # noqa: E402
from dflop_ds.schedule.ranks import lockstep_order  # noqa: E402
from dflop_ds.schedule.splitters import SplitRequest, make_splitter  # noqa: E402
from dflop_ds.shapes import ShapePolicy  # noqa: E402
from dflop_ds.sync import step_cost, step_lower_bound  # noqa: E402

SHARES, RANKS, SYNCS, N_MB, PER_MB, BATCHES = (0.1, 0.4), (8, 64, 256), ("boundary", "microstep", "module"), 4, 2, 3


def old_lockstep(request: SplitRequest) -> np.ndarray:
    """The pre-sync pp=1 split: summed-column partition, ``lockstep_order``; its microbatch times."""
    part = partition_batch(request.costs.sum(axis=1), request.n_mb * request.dp, time_limit_s=0)
    order = lockstep_order(part.bucket_costs, request.dp, request.n_mb)
    return request.predict([[part.buckets[b] for b in rank] for rank in order])


def main() -> None:
    shapes = read_manifest(ROOT / "examples/data/mixture.jsonl", ShapePolicy())
    base = reference_model("llava-ov-7b-h100")
    header = ("share", "dp", "sync", "stock", "verl", "lockstep", "dflop", "bound", "gap", "vs verl", "cpu ms")
    print(" ".join(f"{h:>9}" for h in header))
    summary: dict[str, float] = {"worst": np.inf}
    for share in SHARES:
        model = with_encoder_share(base, shapes, share)
        costs_all = np.asarray(model.predict_samples(list(shapes)), dtype=float)
        for dp in RANKS:
            for sync in SYNCS:
                rows: dict[str, list[float]] = {}
                for seed in range(BATCHES):
                    index = np.random.default_rng(seed).choice(len(shapes), dp * N_MB * PER_MB, replace=False)
                    batch = [shapes[i] for i in index]
                    request = SplitRequest.of_positions(costs_all[index], batch, N_MB, dp, sync=sync)
                    for name in ("stock", "verl"):
                        rows.setdefault(name, []).append(make_splitter(name).split(request).step)
                    rows.setdefault("lockstep", []).append(step_cost(old_lockstep(request), sync))
                    started = time.process_time()  # CPU time: the machine may be shared
                    result = make_splitter("dflop").split(request)
                    rows.setdefault("ms", []).append(1000 * (time.process_time() - started))
                    rows.setdefault("dflop", []).append(result.step)
                    rows.setdefault("bound", []).append(step_lower_bound(request.costs, dp, N_MB, sync))
                m = {k: float(np.mean(v)) for k, v in rows.items()}
                gap, gain = m["dflop"] / m["bound"], m["verl"] / m["dflop"]
                values = [m[k] for k in ("stock", "verl", "lockstep", "dflop", "bound")] + [gap, gain, m["ms"]]
                print(f"{share:>9.0%} {dp:>9} {sync:>9} " + " ".join(f"{v:>9.3f}" for v in values), flush=True)
                summary["worst"] = min(summary["worst"], min(m["stock"], m["verl"]) / m["dflop"])
                if share == 0.4 and dp == 64 and sync == "module":
                    summary["gap"], summary["gain"] = gap, gain
    gap, gain, worst = summary["gap"], summary["gain"], summary["worst"]
    print(f"sync module_gap@64={gap:.3f} module_gain_vs_verl@64={gain:.3f} worst_vs_baselines={worst:.3f}")


if __name__ == "__main__":
    main()
