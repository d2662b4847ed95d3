"""Gantt charts of simulated steps (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dflop_ds.plan.simulator import SimResult


def plot_gantt(panels: Sequence[tuple[str, SimResult]], path: str | Path, *, rank: int | None = None) -> Path:
    """Draw one panel per ``(title, result)``, one above the other, on a shared time axis.

    Each row is a pipeline stage of the slowest rank (or ``rank``); forwards are light,
    backwards dark, in one colour per microbatch; the hatched grey bar is the gradient
    all-reduce. Returns the written path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not panels:
        raise ValueError("plot_gantt needs at least one (title, SimResult) panel")
    heights = [max(1.2, 0.35 * r.n_stages + 0.8) for _, r in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(12, sum(heights) + 0.6),
        sharex=True,
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    cmap = plt.get_cmap("tab20")
    horizon = max(r.step_time for _, r in panels)
    for ax, (title, res) in zip(axes[:, 0], panels):
        r = res.critical_rank if rank is None else rank
        for s in range(res.n_stages):
            for j in range(res.n_mb):
                colour = cmap((2 * j) % 20)
                # the forward pale, the backward solid
                for start, end, alpha in ((res.f_start, res.f_end, 0.55), (res.b_start, res.b_end, 1.0)):
                    ax.barh(
                        s,
                        end[r, j, s] - start[r, j, s],
                        left=start[r, j, s],
                        height=0.8,
                        color=colour,
                        alpha=alpha,
                        edgecolor="none",
                    )
            done = float(np.max(res.b_end[r, :, s]))
            ax.barh(s, res.allreduce[r, s], left=done, height=0.8, color="0.7", hatch="//", edgecolor="0.4")
        ax.set_yticks(range(res.n_stages))
        ax.set_yticklabels([f"stage {s}" for s in range(res.n_stages)])
        ax.invert_yaxis()
        ax.set_xlim(0, horizon * 1.02)
        ax.set_title(f"{title}: step {res.step_time:.3g} s, bubble {res.bubble_fraction:.1%} (rank {r})", fontsize=10)
    axes[-1, 0].set_xlabel("seconds (light: forward, dark: backward, hatched: all-reduce)")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
