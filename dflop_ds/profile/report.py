"""Text tables and a PNG of a FittedCostModel against its measurements (and a DataProfile)."""

from __future__ import annotations

from os import PathLike
from typing import Union

import numpy as np

from dflop_ds.cost import FittedCostModel
from dflop_ds.profile.data import DataProfile

PathArg = Union[str, "PathLike[str]"]


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:8.2f}"


def cost_model_table(model: FittedCostModel) -> str:
    """Measurements next to the fitted predictions, with the relative error, as text."""
    profile = model.profile_
    meta = profile.meta
    lines = [
        f"cost model: encoder {model.encoder_layers} layers, LLM {model.llm_layers} layers; "
        f"device {meta.get('device', '?')}, {meta.get('threads', '?')} thread(s), {meta.get('clock', '?')} clock, "
        f"{meta.get('statistic', '?')} of {meta.get('repeats', '?')}",
    ]
    lines += [f"  {note}" for note in meta.get("scaling", [])]
    params = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in model.param_bytes.items())
    lines.append(f"  parameters: {params}; hidden bytes per token {model.hidden_bytes_per_token:g}")
    lines.append("")
    lines.append(" encoder tiles | measured ms | fitted ms |  error | attention ms | activations MiB | peak MiB")
    fitted = model.encoder_time([m.tiles for m in profile.encoder], [m.attention_units for m in profile.encoder])
    for m, f in zip(profile.encoder, fitted):
        att = "-" if m.attention_s is None else f"{m.attention_s * 1e3:10.2f}"
        lines.append(
            f" {m.tiles:13d} | {m.time_s * 1e3:11.2f} | {f * 1e3:9.2f} | {f / m.time_s - 1:+6.1%} | {att:>12s} |"
            f" {_mib(m.activation_bytes):>15s} | {_mib(m.peak_bytes):>8s}"
        )
    lines.append("")
    lines.append(" LLM batch x seq | measured ms | fitted ms |  error | attention ms | activations MiB | peak MiB")
    fitted = model.llm_time([m.batch for m in profile.llm], [m.seq_len for m in profile.llm])
    for m, f in zip(profile.llm, fitted):
        att = "-" if m.attention_s is None else f"{m.attention_s * 1e3:10.2f}"
        lines.append(
            f" {m.batch:5d} x {m.seq_len:7d} | {m.time_s * 1e3:11.2f} | {f * 1e3:9.2f} | {f / m.time_s - 1:+6.1%} |"
            f" {att:>12s} | {_mib(m.activation_bytes):>15s} | {_mib(m.peak_bytes):>8s}"
        )
    enc_fit = model.encoder_time([m.tiles for m in profile.encoder], [m.attention_units for m in profile.encoder])
    enc_err = np.abs(enc_fit / [m.time_s for m in profile.encoder] - 1)
    llm_err = np.abs(fitted / np.array([m.time_s for m in profile.llm]) - 1)
    lines.append("")
    lines.append(f"fit error (MAPE on the profiled shapes): encoder {enc_err.mean():.3f}, LLM {llm_err.mean():.3f}")
    return "\n".join(lines)


def data_profile_table(profile: DataProfile) -> str:
    """Summary statistics of a data profile, as text."""
    lines = [
        f"data profile of {profile.source}: {len(profile.shapes)} of {profile.n_total} samples (seed {profile.seed})",
        "  modalities: " + ", ".join(f"{k} {v}" for k, v in sorted(profile.modalities.items())),
        "  field          |    mean |     p50 |     p90 |     p99 |     max",
    ]
    for name, stats in profile.stats.items():
        lines.append(
            f"  {name:14s} | {stats['mean']:7.1f} | {stats['p50']:7.1f} | {stats['p90']:7.1f} |"
            f" {stats['p99']:7.1f} | {stats['max']:7.1f}"
        )
    return "\n".join(lines)


def plot_report(model: FittedCostModel, path: PathArg, data: DataProfile | None = None) -> None:
    """Write a PNG: fitted curves over the measurements (encoder, LLM, memory), and the data's
    shape histograms when ``data`` is given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profile = model.profile_
    panels = 4 if data is not None else 3
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    tiles = np.array([m.tiles for m in profile.encoder])
    grid = np.linspace(0, max(tiles.max(), 1), 200)
    ax = axes[0]
    ax.plot(tiles, [m.time_s * 1e3 for m in profile.encoder], "o", label="measured")
    ax.plot(grid, model.encoder_time(grid) * 1e3, "-", label="fit")
    ax.set(title="encoder fwd+bwd (full depth)", xlabel="tiles", ylabel="ms")
    ax.legend()
    ax = axes[1]
    longest = max(m.seq_len for m in profile.llm)
    seq = np.linspace(1, longest, 200)
    for batch in sorted({m.batch for m in profile.llm}):
        points = [m for m in profile.llm if m.batch == batch]
        line = ax.plot(seq, model.llm_time(np.full_like(seq, batch), seq) * 1e3, "-", label=f"B={batch} fit")[0]
        ax.plot([m.seq_len for m in points], [m.time_s * 1e3 for m in points], "o", color=line.get_color())
        attention = model.llm_attention_time(np.full_like(seq, batch), seq)
        if attention is not None:
            ax.plot(seq, attention * 1e3, ":", color=line.get_color())
    ax.set(title="LLM fwd+bwd (dotted: attention)", xlabel="longest sequence (padded)", ylabel="ms")
    ax.legend(fontsize="small")
    ax = axes[2]
    ax.plot(tiles, [m.activation_bytes / 2**20 for m in profile.encoder], "o", label="encoder (x = tiles)")
    ax.plot(grid, model.encoder_bytes_.predict({"T": grid}) / 2**20, "-")
    one = [m for m in profile.llm if m.batch == 1]
    if one:
        ax.plot([m.seq_len for m in one], [m.activation_bytes / 2**20 for m in one], "s", label="LLM B=1 (x = tokens)")
        ax.plot(seq, model.llm_bytes_.predict({"B": np.ones_like(seq), "S": seq}) / 2**20, "-")
    ax.set(title="activation memory (full depth)", xlabel="tiles / tokens", ylabel="MiB")
    ax.legend(fontsize="small")
    if data is not None:
        ax = axes[3]
        for name in ("llm_tokens", "encoder_tiles"):
            hist = data.histograms[name]
            edges = np.asarray(hist["edges"])
            ax.stairs(hist["counts"], edges, label=name)
        ax.set(title=f"data: {len(data.shapes)} sampled shapes", xlabel="value", ylabel="samples")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
