"""Model profiler: forward+backward time, attention time and memory of the real layers.

The encoder segment (its layers, then the projector if given) is swept over tile counts; the
LLM segment over ``(batch, seq_len)`` grids, every sample ``seq_len`` long as in a microbatch
padded to its longest sample. The first profiled layer of a segment gets fresh leaves as inputs
(requiring grad for the LLM, as at a pipeline stage boundary); a few identical blocks stand for
the full depth (:mod:`dflop_ds.profile.layers`), and a full-depth calibration corrects what that
scaling misses (:mod:`dflop_ds.profile.depth`). Attention is timed as the difference between a layer
with and without its attention (:class:`dflop_ds.profile.attention.AttentionOff`).

Timing protocol, built for a shared machine and for the conditions of a training step: every
(layer, size) job is prepared once, then timed in rounds that sweep all input sizes. By default
(``protocol="chain"``) each round runs the profiled layers of one size as one connected
forward+backward pass, every forward first and the backwards in reverse order with all their
activations alive, as a model runs them, and attributes the time to each layer
(:func:`dflop_ds.profile.chain.time_chain`). ``protocol="layer"`` times each layer's
forward+backward on its own, in model order: on the tiny MLLM that predicted padded 3-4-sample
microbatches 5-10% fast and single samples 2-5% slow (bench-costmodel, November 2026). The repeats
are summarized by a robust statistic (``min`` by default: the pass least disturbed by other
processes; ``median`` and ``trimmed_mean`` are available). On a CPU the clock is the process's CPU
time, which a co-running process does not inflate the way it inflates wall time.
Memory: the bytes autograd saves for backward (exact, any device) and the peak growth
(accelerator peak allocation; on a CPU the peak RSS, which the allocator's cache often hides).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dflop_ds.cost.measurements import Measurement, ModelProfile
from dflop_ds.profile.attention import AttentionOff
from dflop_ds.profile.chain import time_chain
from dflop_ds.profile.depth import DepthScale, calibration_points, depth_scale
from dflop_ds.profile.inputs import EncoderInputFactory, LLMInputFactory
from dflop_ds.profile.layers import ProfiledLayer, describe_selection, parameter_bytes, select_layers
from dflop_ds.profile.timing import (
    Inputs,
    OutputLoss,
    PeakMemory,
    as_tuple,
    clock_function,
    forward_backward,
    prepare_inputs,
    profiling_device,
    resolve_clock,
    robust_statistic,
    saved_activation_bytes,
)

#: Version of the timing protocol: profiles taken under another one are not reused from a cache
#: (2: layers timed on their own in model order; 3: layers timed inside one connected pass)
TIMING_PROTOCOL = 3

#: How the layers of one input size are timed (see the module's docstring)
PROTOCOLS = ("chain", "layer")

#: Default sweeps for the bundled tiny model (TINY_POLICY: 16 tokens per tile/frame).
DEFAULT_TILES = (1, 2, 4, 8, 16, 32, 64, 96)
DEFAULT_SEQ_LENS = (16, 64, 128, 256, 384, 512, 768)
DEFAULT_BATCH_SIZES = (1, 2, 4)


#: ``(time_s, attention_s, activation_bytes, peak_bytes)`` of one input size at full depth
PointSummary = tuple[float, float | None, int, int | None]


@dataclass
class SegmentRun:
    """Settings shared by every timing of a profiling run."""

    warmup: int = 1
    repeats: int = 5
    statistic: str = "min"
    clock: str = "auto"
    attention_off: Callable[[], AbstractContextManager[Any]] | None = None
    device: torch.device = field(default_factory=profiling_device)
    protocol: str = "chain"


@dataclass
class LayerJob:
    """One profiled layer at one input size: prepared inputs, memory, and its timings."""

    point: int
    layer: torch.nn.Module
    weight: float
    inputs: Inputs
    activation_bytes: int
    transient_bytes: int | None
    attention_off: Callable[[], AbstractContextManager[Any]] | None
    loss: OutputLoss | None = None
    full: list[float] = field(default_factory=list)
    without_attention: list[float] = field(default_factory=list)


def _uses_attention(layer: torch.nn.Module, inputs: Inputs) -> bool:
    probe = AttentionOff()
    with torch.no_grad(), probe:
        layer(inputs)
    return probe.calls > 0


def prepare_jobs(
    point: int,
    layers: Sequence[torch.nn.Module],
    selection: Sequence[ProfiledLayer],
    inputs: Inputs,
    run: SegmentRun,
    *,
    first_input_grad: bool,
    output_loss: OutputLoss | None = None,
) -> list[LayerJob]:
    """The jobs of one input size: run the selected layers in order, each on the (detached)
    output of the previous one, measuring its saved activations and peak memory once.

    ``output_loss`` turns the outputs of the segment's last layer into the scalar loss.
    """
    jobs = []
    current = inputs
    for position, chosen in enumerate(selection):
        layer = layers[chosen.index]
        loss = output_loss if chosen.index == len(layers) - 1 else None
        leaf = prepare_inputs(current, run.device, requires_grad=first_input_grad or position > 0)
        with saved_activation_bytes(list(layer.parameters())) as saved:
            forward_backward(layer, leaf, loss)
        with PeakMemory() as peak:
            forward_backward(layer, leaf, loss)
        transient = None if peak.bytes is None else max(0, peak.bytes - saved[0])
        if run.attention_off is not None:
            off: Callable[[], AbstractContextManager[Any]] | None = run.attention_off
        else:
            off = AttentionOff if _uses_attention(layer, leaf) else None
        jobs.append(LayerJob(point, layer, chosen.weight, leaf, saved[0], transient, off, loss))
        with torch.no_grad():
            out = layer(leaf)
        current = as_tuple(out)
    return jobs


def run_rounds(jobs: Sequence[LayerJob], run: SegmentRun, bar: Any = None) -> None:
    """Time every job ``warmup + repeats`` times, one pass per job per round.

    Rounds sweep all input sizes, so a change of machine load during profiling spreads over all
    of them instead of bending one end of a curve. ``jobs`` come in model order within an input
    size and sizes in increasing order. Under ``run.protocol == "chain"`` the jobs of one size
    run as one connected pass (twice when some use attention: with it and without); under
    ``"layer"`` each job is timed on its own, right after the job before it.
    """
    now = clock_function(run.clock)
    groups: list[list[LayerJob]] = []
    for job in jobs:
        if run.protocol == "chain" and groups and groups[-1][0].point == job.point:
            groups[-1].append(job)
        else:
            groups.append([job])
    for round_index in range(run.warmup + run.repeats):
        keep = round_index >= run.warmup
        for group in groups:
            full = _time_group(group, now)
            off = next((job.attention_off for job in group if job.attention_off is not None), None)
            without = _time_group(group, now, off) if off is not None else None
            if not keep:
                continue
            for position, job in enumerate(group):
                job.full.append(full[position])
                if without is not None and job.attention_off is not None:
                    job.without_attention.append(without[position])
        if bar is not None:
            bar.update(1)


def _time_group(
    group: Sequence[LayerJob], now: Callable[[], float], context: Callable[[], Any] | None = None
) -> list[float]:
    """Seconds of each job of ``group``, run as one chain (a single job: on its own)."""
    return time_chain(
        [job.layer for job in group], group[0].inputs, now, loss=group[-1].loss, context=context or nullcontext
    )


def summarize_point(jobs: Sequence[LayerJob], statistic: str) -> PointSummary:
    """Full-depth ``(time_s, attention_s, activation_bytes, peak_bytes)`` of one input size.

    The time is the statistic of each round's weighted sum over the layers (as a whole pass is
    summarized), not the sum of each layer's statistic, which with ``min`` would pick every
    layer's luckiest round. Peak memory at full depth is every layer's saved activations plus
    the largest transient.
    """
    rounds = min(len(job.full) for job in jobs)
    time_s = robust_statistic([sum(job.weight * job.full[r] for job in jobs) for r in range(rounds)], statistic)
    attention_s, activations = None, 0.0
    transients = [job.transient_bytes for job in jobs if job.transient_bytes is not None]
    for job in jobs:
        if job.without_attention:
            full = robust_statistic(job.full, statistic)
            share = max(0.0, full - robust_statistic(job.without_attention, statistic))
            attention_s = (attention_s or 0.0) + job.weight * share
        activations += job.weight * job.activation_bytes
    peak = int(activations + max(transients)) if transients and len(transients) == len(jobs) else None
    return time_s, attention_s, int(activations), peak


def held_bytes(jobs: Sequence[LayerJob], protocol: str) -> int:
    """Activation bytes profiling held at once for one input size: every profiled layer's saved
    activations plus the largest transient under ``"chain"``, the largest single layer's otherwise."""
    per_job = [(job.activation_bytes, job.transient_bytes or 0) for job in jobs]
    if protocol == "chain":
        return sum(saved for saved, _ in per_job) + max(transient for _, transient in per_job)
    return max(saved + transient for saved, transient in per_job)


def calibrate_depth(
    layers: Sequence[torch.nn.Module],
    jobs_per_point: Sequence[Sequence[LayerJob]],
    summaries: Sequence[PointSummary],
    order: Sequence[int],
    run: SegmentRun,
    *,
    loss: OutputLoss | None = None,
    bar: Any = None,
) -> DepthScale:
    """:func:`~dflop_ds.profile.depth.depth_scale` of a segment (all of ``layers``) at a few of its
    profiled sizes (``summaries``: :func:`summarize_point` of each; ``order``: point indices by
    increasing size)."""
    if not jobs_per_point:
        return DepthScale(1.0, ())
    budget = max(held_bytes(jobs, run.protocol) for jobs in jobs_per_point)
    full_bytes = [
        summary[2] + max(job.transient_bytes or 0 for job in jobs) for summary, jobs in zip(summaries, jobs_per_point)
    ]
    picks = [i for i in calibration_points(order, full_bytes, budget) if summaries[i][0] > 0]
    return depth_scale(
        layers,
        [jobs_per_point[i][0].inputs for i in picks],
        [summaries[i][0] for i in picks],
        clock_function(run.clock),
        rounds=run.repeats,
        warmup=run.warmup,
        statistic=run.statistic,
        loss=loss,
        bar=bar,
    )


def scaled_point(summary: PointSummary, factor: float) -> PointSummary:
    """A :func:`summarize_point` result with both times multiplied by ``factor``."""
    time_s, attention_s, activations, peak = summary
    return time_s * factor, None if attention_s is None else attention_s * factor, activations, peak


def layer_time_shares(
    jobs_per_point: Sequence[Sequence[LayerJob]],
    selection: Sequence[ProfiledLayer],
    layer_names: Sequence[str],
    statistic: str,
) -> list[float]:
    """Each layer's share of its segment's time, averaged over the profiled input sizes.

    ``jobs_per_point[k][i]`` times ``selection[i]``; a block that was not profiled takes the
    mean time of its profiled siblings (same class name).
    """
    shares = np.zeros(len(layer_names))
    for jobs in jobs_per_point:
        measured = {chosen.index: robust_statistic(job.full, statistic) for chosen, job in zip(selection, jobs)}
        by_name: dict[str, list[float]] = {}
        for index, seconds in measured.items():
            by_name.setdefault(layer_names[index], []).append(seconds)
        times = np.array([measured.get(i, float(np.mean(by_name[name]))) for i, name in enumerate(layer_names)])
        if times.sum() > 0:
            shares += times / times.sum()
    total = shares.sum()
    return [float(x) for x in (shares / total if total > 0 else np.full(len(layer_names), 1 / len(layer_names)))]


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(threads)`` (unchanged when ``None``)."""
    if threads is None:
        yield
        return
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _progress(total: int, enabled: bool, desc: str):  # noqa: ANN202 - tqdm or a no-op
    if not enabled:
        return nullcontext(None)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="round", leave=False)


def profile_model(
    encoder_layers: Sequence[torch.nn.Module],
    llm_layers: Sequence[torch.nn.Module],
    *,
    encoder_inputs: EncoderInputFactory,
    llm_inputs: LLMInputFactory,
    projector: torch.nn.Module | None = None,
    tiles: Sequence[int] = DEFAULT_TILES,
    seq_lens: Sequence[int] = DEFAULT_SEQ_LENS,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    llm_shapes: Sequence[tuple[int, int]] | None = None,
    max_blocks: int = 2,
    warmup: int = 1,
    repeats: int = 5,
    statistic: str = "min",
    clock: str = "auto",
    threads: int | None = 1,
    attention_off: Callable[[], AbstractContextManager[Any]] | None = None,
    output_loss: OutputLoss | None = None,
    progress: bool = True,
    seed: int = 0,
    protocol: str = "chain",
    calibrate: bool = True,
) -> ModelProfile:
    """Profile forward+backward of an encoder and an LLM, given as flat lists of layers.

    Args:
        encoder_layers: vision encoder layers; the first receives the factory's raw inputs.
        llm_layers: LLM layers (the head included if it is one of them).
        encoder_inputs: ``(tiles, batch) -> tuple`` inputs of the first encoder layer.
        llm_inputs: ``(batch, seq_len) -> tuple`` inputs of the first LLM layer.
        projector: optional layer run after the encoder; its time counts as encoder time.
        tiles, seq_lens, batch_sizes: the sweeps (encoder: one sample of ``tiles`` tiles; LLM:
            the grid ``batch_sizes x seq_lens``).
        llm_shapes: explicit ``(batch, seq_len)`` pairs for the LLM instead of the grid.
        max_blocks: identical blocks profiled per segment; they are scaled to the full depth.
        warmup, repeats, statistic: timing protocol (see :func:`robust_statistic`).
        clock: ``"wall"``, ``"cpu"`` (process CPU time) or ``"auto"`` (CPU time on a CPU device,
            wall time on an accelerator), see :func:`resolve_clock`.
        threads: torch threads while profiling (training ranks use 1); ``None`` keeps the current.
        attention_off: context factory disabling attention, for models that do not call
            ``scaled_dot_product_attention``.
        output_loss: maps the last LLM layer's outputs to the scalar training loss, so that its
            cost is counted (default: backward from a gradient of ones).
        progress: show a tqdm progress bar.
        seed: seeds the random inputs.
        protocol: ``"chain"`` (default) times the layers of one input size inside one connected
            pass, ``"layer"`` each on its own (see the module's docstring).
        calibrate: scale each segment's times by its whole depth's measured time at a few sizes
            (:mod:`dflop_ds.profile.depth`); off, the profiled layers' times are only multiplied out.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    run = SegmentRun(
        warmup=warmup,
        repeats=repeats,
        statistic=statistic,
        clock=resolve_clock(clock),
        attention_off=attention_off,
        protocol=protocol,
    )
    encoder_chain = list(encoder_layers) + ([projector] if projector is not None else [])
    encoder_pick = select_layers(encoder_chain, max_blocks)
    llm_pick = select_layers(list(llm_layers), max_blocks)
    for module in encoder_chain + list(llm_layers):
        module.to(run.device).train()
    torch.manual_seed(seed)
    grid = list(llm_shapes) if llm_shapes is not None else [(b, s) for b in batch_sizes for s in seq_lens]
    started = time.perf_counter()
    with torch_threads(threads):
        encoder_jobs = [
            prepare_jobs(i, encoder_chain, encoder_pick, encoder_inputs(count, 1), run, first_input_grad=False)
            for i, count in enumerate(tiles)
        ]
        llm_jobs = [
            prepare_jobs(
                i, list(llm_layers), llm_pick, llm_inputs(b, s), run, first_input_grad=True, output_loss=output_loss
            )
            for i, (b, s) in enumerate(grid)
        ]
        # each segment in its own rounds, smallest inputs first, so that every job follows
        # one of a similar size
        by_tokens = sorted(range(len(grid)), key=lambda i: (grid[i][0] * grid[i][1], grid[i]))
        by_tiles = sorted(range(len(tiles)), key=lambda i: tiles[i])
        with _progress((4 if calibrate else 2) * (warmup + repeats), progress, "profile model") as bar:
            run_rounds([job for jobs in encoder_jobs for job in jobs], run, bar)
            run_rounds([job for i in by_tokens for job in llm_jobs[i]], run, bar)
            encoder_summaries = [summarize_point(jobs, statistic) for jobs in encoder_jobs]
            llm_summaries = [summarize_point(jobs, statistic) for jobs in llm_jobs]
            if calibrate:
                encoder_scale = calibrate_depth(encoder_chain, encoder_jobs, encoder_summaries, by_tiles, run, bar=bar)
                llm_scale = calibrate_depth(
                    list(llm_layers), llm_jobs, llm_summaries, by_tokens, run, loss=output_loss, bar=bar
                )
            else:
                encoder_scale = llm_scale = DepthScale(1.0, ())
    for module in encoder_chain + list(llm_layers):
        module.zero_grad(set_to_none=True)  # profiling's gradients are not the caller's
    windows = getattr(encoder_inputs, "attention_units", None)  # (tiles, batch) -> attention units, if known
    encoder_points = [
        Measurement(
            *scaled_point(summary, encoder_scale.factor),
            tiles=int(count),
            attention_units=None if windows is None else int(windows(count, 1)),
        )
        for summary, count in zip(encoder_summaries, tiles)
    ]
    llm_points = [
        Measurement(*scaled_point(summary, llm_scale.factor), batch=int(b), seq_len=int(s))
        for summary, (b, s) in zip(llm_summaries, grid)
    ]
    shares = {
        "encoder": layer_time_shares(encoder_jobs, encoder_pick, [type(m).__name__ for m in encoder_chain], statistic),
        "llm": layer_time_shares(llm_jobs, llm_pick, [type(m).__name__ for m in llm_layers], statistic),
    }
    if projector is None:  # the flat pipeline list always has a projector slot; none costs nothing
        shares["encoder"].append(0.0)
    sample_hidden = llm_inputs(1, 1)[0]
    notes = [
        describe_selection("encoder", encoder_pick, len(encoder_chain)),
        describe_selection("llm", llm_pick, len(llm_layers)),
    ]
    if calibrate:
        notes += [encoder_scale.describe("encoder"), llm_scale.describe("llm")]
    meta = {
        "device": str(run.device),
        "threads": threads if threads is not None else torch.get_num_threads(),
        "warmup": warmup,
        "repeats": repeats,
        "statistic": statistic,
        "clock": run.clock,
        "max_blocks": max_blocks,
        "protocol": protocol,
        "depth_scale": {"encoder": encoder_scale.factor, "llm": llm_scale.factor},
        "scaling": notes,
        "projector_in_encoder": projector is not None,
        "output_loss": output_loss is not None,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "seconds": round(time.perf_counter() - started, 3),
    }
    return ModelProfile(
        encoder=encoder_points,
        llm=llm_points,
        encoder_layers=len(encoder_layers),
        llm_layers=len(llm_layers),
        param_bytes={
            "encoder": parameter_bytes(list(encoder_layers)),
            "projector": parameter_bytes([projector]) if projector is not None else 0,
            "llm": parameter_bytes(list(llm_layers)),
        },
        hidden_bytes_per_token=float(sample_hidden.shape[-1] * sample_hidden.element_size()),
        meta=meta,
        layer_shares=shares,
    )


__all__ = [
    "DEFAULT_BATCH_SIZES",
    "DEFAULT_SEQ_LENS",
    "DEFAULT_TILES",
    "PROTOCOLS",
    "Measurement",
    "ModelProfile",
    "layer_time_shares",
    "prepare_jobs",
    "profile_model",
    "run_rounds",
    "summarize_point",
    "torch_threads",
]
