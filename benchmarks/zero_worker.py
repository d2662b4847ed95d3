"""One rank of `make validate-simulator`'s ZeRO table (launched under `deepspeed` by
:func:`benchmarks.validate_simulator.validate_zero`).

The encoder-heavy tiny HF LLaVA (:func:`dflop_ds.testing.hf_tiny.build_encoder_heavy_llava`) under
one DeepSpeed engine per ``--configs`` entry (ZeRO-1/2/3 with buckets below a layer's size, and
ZeRO-2 with DeepSpeed's default buckets), each step two microbatches per rank. Every round runs
each split of :data:`SPLITS` once on every engine, in a rotating order: the same microbatches on
both ranks (``twin``), heavy and light microbatches in the same or the opposite order on the two
ranks, and an encoder-heavy and an LLM-heavy microbatch on both ranks in the same order or crossed.
Per step it records the wall time and, per rank and microbatch, the encoder's seconds (forward:
the vision tower's; backward: from the gradient reaching the tower's output to the one reaching its
patch embeddings) and the microbatch's forward + backward seconds. Rank 0 writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import worker_ds_config  # noqa: E402
from dflop_ds.jsonio import read_json_object  # noqa: E402
from dflop_ds.rank_lifecycle import finish_rank  # noqa: E402
from dflop_ds.train.loop import start_distributed  # noqa: E402

#: the microbatch kinds: (images, text tokens), one sequence each. ``heavy``/``light`` differ in
#: total work; ``encoder``/``llm`` take about the same total time on the encoder-heavy model, one
#: mostly in the vision tower, the other mostly in the LLM.
KINDS = {"heavy": (12, 400), "light": (1, 16), "encoder": (12, 16), "llm": (1, 680)}
#: the splits: per rank, its two microbatches in order
SPLITS = {
    "twin_order": (("heavy", "light"), ("heavy", "light")),
    "misaligned_order": (("heavy", "light"), ("light", "heavy")),
    "twin_halves": (("encoder", "llm"), ("encoder", "llm")),
    "crossed_halves": (("encoder", "llm"), ("llm", "encoder")),
}


class ModuleClock:
    """Seconds of the vision tower of an HF LLaVA on this rank, forward and backward, per microbatch."""

    def __init__(self, model: Any) -> None:
        tower = model.model.vision_tower
        self.seconds = 0.0
        self._start = 0.0
        self._grad_start: float | None = None
        tower.register_forward_pre_hook(self._forward_start)
        tower.register_forward_hook(self._forward_end)
        tower.embeddings.register_forward_hook(self._embeddings_out)

    def _forward_start(self, *_):
        self._start = time.perf_counter()

    def _forward_end(self, _module, _inputs, output):
        self.seconds += time.perf_counter() - self._start
        hidden = output.last_hidden_state
        if hidden.requires_grad:
            hidden.register_hook(self._grad_arrived)

    def _embeddings_out(self, _module, _inputs, output):
        if output.requires_grad:
            output.register_hook(self._grad_done)

    def _grad_arrived(self, grad):
        self._grad_start = time.perf_counter()
        return grad

    def _grad_done(self, grad):
        if self._grad_start is not None:
            self.seconds += time.perf_counter() - self._grad_start
            self._grad_start = None
        return grad

    def take(self) -> float:
        """Seconds since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def microbatch(kind: str, image_token: int, seed: int) -> dict:
    """The inputs of one microbatch of ``kind``: its image tokens first, then text, all supervised."""
    images, text = KINDS[kind]
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (1, images * 16 + text), generator=generator)
    ids[0, : images * 16] = image_token
    labels = ids.clone()
    labels[0, : images * 16] = -100
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(images, 3, 32, 32, generator=generator),
        "labels": labels,
    }


def engine_for(model_dir: str, config_path: str, dp: int, seed: int):
    """A DeepSpeed engine over a fresh copy of the model, with the ZeRO block of ``config_path``."""
    import deepspeed
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    config = worker_ds_config(2 * dp, 2, dp)
    config["zero_optimization"] = read_json_object(config_path)["zero_optimization"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, ModuleClock(model)


def step(engine, clock: ModuleClock, batches: list[dict]) -> tuple[float, list[tuple[float, float]]]:
    """One optimizer step over ``batches`` started together on every rank: its wall seconds and,
    per microbatch, (encoder seconds, forward + backward seconds) on this rank."""
    torch.distributed.barrier()
    start = time.perf_counter()
    times = []
    clock.take()
    for batch in batches:
        began = time.perf_counter()
        loss = engine(**batch).loss
        engine.backward(loss)
        times.append((clock.take(), time.perf_counter() - began))
        engine.step()
    return time.perf_counter() - start, times


def largest_layer(model: torch.nn.Module) -> int:
    """Parameters of the model's largest layer (a numbered child of a ``layers`` list), counted
    in full (ZeRO-3 keeps each rank's shard; ``ds_numel`` is the whole tensor's)."""
    return max(
        sum(getattr(p, "ds_numel", p.numel()) for p in layer.parameters())
        for name, layers in model.named_modules()
        if name.endswith("layers") and isinstance(layers, torch.nn.ModuleList)
        for layer in layers
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--model", required=True)
    parser.add_argument("--configs", required=True, help="comma-separated label=path of DeepSpeed configs")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dp, rank = start_distributed(args.seed)
    torch.set_num_threads(1)
    configs = dict(entry.split("=", 1) for entry in args.configs.split(","))
    engines = {label: engine_for(args.model, path, dp, args.seed) for label, path in configs.items()}
    image_token = int(next(iter(engines.values()))[0].module.config.image_token_index)
    inputs = {kind: microbatch(kind, image_token, args.seed + k) for k, kind in enumerate(KINDS)}
    runs = [(label, split) for label in engines for split in SPLITS]
    rows = []
    for round_id in range(args.warmup + args.rounds):
        shift = round_id % len(runs)
        for label, split in runs[shift:] + runs[:shift]:
            kinds = SPLITS[split][rank % 2]
            engine, clock = engines[label]
            wall, times = step(engine, clock, [inputs[kind] for kind in kinds])
            everyone: list = [None] * dp
            torch.distributed.all_gather_object(everyone, times)
            rows.append(
                {
                    "round": round_id,
                    "warmup": round_id < args.warmup,
                    "config": label,
                    "split": split,
                    "step_s": wall,
                    "kinds": [list(SPLITS[split][r % 2]) for r in range(dp)],
                    "times": everyone,
                }
            )
            if rank == 0:
                print(f"[zero] round {round_id:2d} {label:10s} {split:17s} step {wall:.3f}s", flush=True)
    if rank == 0:
        model = next(iter(engines.values()))[0].module
        written = {"rows": rows, "dp": dp, "configs": configs, "largest_layer": largest_layer(model)}
        Path(args.out).write_text(json.dumps(written, indent=1))
    finish_rank()
    return 0


if __name__ == "__main__":
    sys.exit(main())
