"""Attention of packed microbatches on this machine: which per-sample attention is fastest.

Forward+backward of causal attention (4 heads of 32, the tiny model's) over the samples of one
microbatch, for: padded SDPA with a mask (the padded collate), one SDPA per sample over the
packed row (what :mod:`dflop_ds.models.packing` uses), a dense block mask over the packed row
(costs ``N^2``), nested jagged tensors and ``flex_attention`` (reported as failing where torch
refuses them), then the whole tiny model, padded against packed, on the same microbatch.
Candidates run in interleaved rounds and the median is reported.
Run: ``python benchmarks/bench_packed_attention.py`` (under a minute; figures depend on load).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflop_ds.models import TinyMLLMDataset, build_reference, collate_microbatch  # noqa: E402
from dflop_ds.models.packing import segment_causal_attention, segment_positions  # noqa: E402
from dflop_ds.pipe.loss import token_normalized_loss  # noqa: E402
from dflop_ds.shapes import TINY_POLICY  # noqa: E402

HEADS, HEAD_DIM = 4, 32
MICROBATCHES = {"mixed 8": [40, 70, 120, 200, 330, 90, 60, 150], "wide 6": [30, 500, 80, 640, 45, 260]}


def median_ms(candidates: dict[str, Callable[[], object]], rounds: int = 15) -> dict[str, float | str]:
    """Median milliseconds per call of each candidate, timed in interleaved rounds after a warm-up
    call (so machine load hits all alike); a candidate torch refuses gets its error instead."""
    times: dict[str, list[float] | str] = {}
    for label, fn in candidates.items():
        try:
            fn()
            times[label] = []
        except (RuntimeError, NotImplementedError) as error:
            times[label] = f"fails: {type(error).__name__}: {str(error).splitlines()[0][:90]}"
    for _ in range(rounds):
        for label, fn in candidates.items():
            if isinstance(times[label], list):
                start = time.perf_counter()
                fn()
                times[label].append(1e3 * (time.perf_counter() - start))
    return {label: t if isinstance(t, str) else statistics.median(t) for label, t in times.items()}


def attention_candidates(lengths: list[int]) -> dict[str, Callable[[], object]]:
    """Forward+backward closures of every candidate over samples of ``lengths``."""
    n, longest, lens = sum(lengths), max(lengths), torch.tensor(lengths)
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, requires_grad=True) for _ in range(3))
    padded = [torch.randn(len(lengths), HEADS, longest, HEAD_DIM, requires_grad=True) for _ in range(3)]
    pos = torch.arange(longest)
    pad_mask = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < lens[:, None, None])
    pad_mask[:, :, 0] = True
    segment, _ = segment_positions(lens)
    flat = torch.arange(n)
    dense_mask = ((segment[:, None] == segment[None, :]) & (flat[None, :] <= flat[:, None]))[None, None]

    def nested() -> object:
        rows = torch.nested.nested_tensor(
            [torch.randn(length, HEADS, HEAD_DIM) for length in lengths], layout=torch.jagged, requires_grad=True
        ).transpose(1, 2)
        return F.scaled_dot_product_attention(rows, rows, rows, is_causal=True)

    def flex() -> object:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = create_block_mask(
            lambda b, h, i, j: (segment[i] == segment[j]) & (j <= i), None, None, n, n, device=str(q.device)
        )
        return flex_attention(q, k, v, block_mask=mask)

    return {
        "padded SDPA + mask": lambda: F.scaled_dot_product_attention(*padded, attn_mask=pad_mask[:, None]),
        "one SDPA per sample (packed)": lambda: segment_causal_attention(q, k, v, lengths),
        "dense block mask (packed, N^2)": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask),
        "nested jagged SDPA": nested,
        "flex_attention block mask": flex,
    }


def backward_of(forward: Callable[[], object]) -> Callable[[], None]:
    """``forward`` followed by the backward of the sum of its output."""

    def run() -> None:
        out = forward()
        (out.values() if out.is_nested else out).sum().backward()

    return run


def whole_model(lengths: list[int]) -> dict[str, Callable[[], None]]:
    """Forward+backward of the default tiny model on text-only samples of ``lengths``, padded and packed."""
    model = build_reference()
    shapes = [TINY_POLICY.shape(f"s{i}", text_tokens=n, label_tokens=n // 4) for i, n in enumerate(lengths)]
    items = [TinyMLLMDataset(shapes)[i] for i in range(len(shapes))]

    def step(packed: bool) -> Callable[[], None]:
        inputs, labels = collate_microbatch(items, packed=packed)
        return lambda: token_normalized_loss(model(inputs), labels).backward()

    return {"tiny model padded": step(False), "tiny model packed": step(True)}


def main() -> int:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, lengths in MICROBATCHES.items():
        print(f"{name}: lengths {lengths} (sum {sum(lengths)}, longest {max(lengths)})")
        attention = {label: backward_of(forward) for label, forward in attention_candidates(lengths).items()}
        for label, ms in {**median_ms(attention), **median_ms(whole_model(lengths), rounds=5)}.items():
            print(f"  {label:34s} " + (ms if isinstance(ms, str) else f"{ms:8.2f} ms (median)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
