"""One rank of `make bench-trainer`: the same Trainer script trained with each sampling strategy in
turn, round after round, under ``--deepspeed`` (ZeRO-2 by default), for a LLaVA
(examples/hf_trainer.py's Dataset and padded collator) or a Qwen2-VL model
(:mod:`benchmarks.trainer_qwen2_vl`'s Dataset and collators).

Strategies: ``random`` (the Trainer's default), ``group_by_length`` and ``batch_rebalance``
(transformers' own), ``padding_free`` (random order, transformers' flattening collator, with
M-RoPE positions for Qwen2-VL, sdpa), ``stock_packed`` (random order, padding-free with the
project's per-sample attention: packing's gain without balancing), ``dflop`` (``DFLOPTrainer``,
the padded collator, the profiled cost model) and ``dflop_packed`` (``DFLOPTrainer`` with
``dflop={"model": {"packing": True}}`` and no collator: it packs with the family's padding-free
collator and the project's attention, balancing the packed cost); ``llamafactory_packing`` and
``swift_packing`` are those frameworks' packers (registered splitters) in ``DFLOPTrainer``'s
packing path, their packs dealt to ranks as the Trainer deals rows. The baselines named in
``--guarded`` run with the blank-image guard (``BlankImageGuardMixin``); the project's
configurations and the packers (in DFLOPTrainer) always have it. Each run trains one epoch (or ``--steps``
optimizer steps) from the same initial weights; the first step is left out of the timing. Rank 0
writes ``--out`` (JSON): per round and strategy, samples/s, padding efficiency (real tokens /
padded tokens) and rank imbalance (per step, the slowest rank's forward time over the mean,
averaged over the timed steps).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForImageTextToText, AutoProcessor, Trainer, TrainerCallback, TrainingArguments

from benchmarks.common import mean_of
from benchmarks.trainer_qwen2_vl import Qwen2VLJsonDataset, Qwen2VLPadCollator
from dflop_ds.hf_trainer import (
    BlankImageGuardMixin,
    DFLOPTrainer,
    llava_json_shapes,
    padding_free_collator,
    use_segment_attention,
)
from dflop_ds.hf_trainer.guard import has_images
from dflop_ds.rank_lifecycle import finish_rank

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer.py"
_spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
example = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules[_spec.name] = example  # type: ignore[union-attr]
_spec.loader.exec_module(example)  # type: ignore[union-attr]

#: each strategy: (the transformers sampling strategy it runs under, its collator: ``padded``,
#: ``flat`` (transformers' padding-free path, sdpa), ``segments`` (padding-free with the samples'
#: bounds and the project's per-sample attention, ``use_segment_attention``) or ``packing``
#: (DFLOPTrainer's own with ``dflop.model.packing``: the ``segments`` collator and attention))
STRATEGIES = {
    "random": ("random", "padded"),
    "group_by_length": ("group_by_length", "padded"),
    "batch_rebalance": ("batch_rebalance", "padded"),
    "padding_free": ("random", "flat"),
    "stock_packed": ("random", "segments"),
    "dflop": ("random", "padded"),
    "dflop_packed": ("random", "packing"),
    "llamafactory_packing": ("random", "packing"),
    "swift_packing": ("random", "packing"),
}
#: the strategies DFLOPTrainer runs, each with its registered splitter (``dflop.sampler.kind``): the
#: project's, and the frameworks' packers (LLaMA-Factory's greedy knapsack, ms-swift's
#: best-fit-decreasing), whose packs its sampler deals to the ranks as the Trainer deals rows
SPLITTER_OF = {
    "dflop": "dflop",
    "dflop_packed": "dflop",
    "llamafactory_packing": "llamafactory_packing",
    "swift_packing": "swift_packing",
}
#: the project's own configurations (always with the blank-image guard)
PROJECT = ("stock_packed", "dflop", "dflop_packed")


class GuardedTrainer(BlankImageGuardMixin, Trainer):
    """The stock Trainer with only the blank-image guard (a fair baseline under ZeRO-2)."""


class StepClock(TrainerCallback):
    """Wall time of each optimizer step and this rank's forward time in it (ZeRO-2's backward
    waits for the other ranks' gradients, so only the forward measures a rank's own work)."""

    def __init__(self) -> None:
        self.step_start = 0.0
        self.busy = 0.0
        self.steps: list[tuple[float, float]] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_start = time.perf_counter()
        self.busy = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append((time.perf_counter() - self.step_start, self.busy))


class TimedStep:
    """Adds each microbatch's forward (loss) time to the clock's busy time, notes whether the
    microbatch came with visual input (before any guard) and counts its real and padded tokens
    (all real without an ``attention_mask``), here in the training process, whichever process
    collated it (``dataloader_num_workers``)."""

    clock: StepClock
    visual: list[bool]
    real: int
    padded: int

    def compute_loss(self, model, inputs, *args, **kwargs):
        self.visual.append(has_images(inputs))
        mask = inputs.get("attention_mask")
        self.real += int(inputs["input_ids"].numel() if mask is None else mask.sum())
        self.padded += inputs["input_ids"].numel()
        start = time.perf_counter()
        loss = super().compute_loss(model, inputs, *args, **kwargs)  # type: ignore[misc]
        self.clock.busy += time.perf_counter() - start
        return loss


def mixed_microbatches(visual: list[bool]) -> int:
    """Microbatch slots (same index on every rank) where some ranks had visual input and some had
    none: where ZeRO-2 reduces different gradients without the blank-image guard."""
    flags = torch.tensor(visual, dtype=torch.int64)
    everyone = [torch.zeros_like(flags) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flags)
    stacked = torch.stack(everyone)
    return int((stacked.min(dim=0).values != stacked.max(dim=0).values).sum())


def trainer_class(strategy: str, guarded: bool) -> type:
    base = DFLOPTrainer if strategy in SPLITTER_OF else GuardedTrainer if guarded else Trainer
    return type(f"Timed{base.__name__}", (TimedStep, base), {})


def dataset_and_collate(cli, shapes, model, kind: str) -> tuple:
    """``(train_dataset, collate)`` of the model family, ``kind`` of collator (see :data:`STRATEGIES`;
    None for ``packing``: DFLOPTrainer picks it)."""
    if kind == "segments":
        use_segment_attention(model)
    qwen = cli.family == "qwen2_vl"
    if qwen:
        dataset = Qwen2VLJsonDataset(shapes, cli.data, cli.model, cli.images, cli.videos)
        padded = Qwen2VLPadCollator(model.config.text_config.pad_token_id)
    else:
        processor = AutoProcessor.from_pretrained(cli.model)
        dataset = example.LlavaJsonDataset(cli.data, cli.images, processor)
        padded = example.PadCollator(processor.tokenizer.pad_token_id)
    if kind == "padded":
        return dataset, padded
    if kind == "packing":
        return dataset, None
    return dataset, padding_free_collator(model, sample_bounds=kind == "segments")


def dflop_settings(strategy: str, cli) -> dict:
    """The ``"dflop"`` block: the strategy's splitter, the profiled cost model; packing for the
    strategies of the ``packing`` collator."""
    sampler = {"kind": SPLITTER_OF[strategy]}
    if cli.cost_model is not None:
        sampler["cost_model"] = cli.cost_model
    return {"sampler": sampler, "model": {"packing": STRATEGIES[strategy][1] == "packing"}}


def run(strategy: str, cli, shapes) -> dict:
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(cli.model)
    model.config.get_text_config().use_cache = False  # training keeps no cache (and packing needs none)
    sampling, kind = STRATEGIES[strategy]
    dataset, collate = dataset_and_collate(cli, shapes, model, kind)
    clock = StepClock()
    args = TrainingArguments(
        output_dir=str(Path(cli.out).parent / "trainer_runs" / strategy),
        use_cpu=True,
        deepspeed=cli.deepspeed,
        per_device_train_batch_size=cli.batch,
        gradient_accumulation_steps=cli.gas,
        max_steps=cli.steps,
        num_train_epochs=1,
        learning_rate=1e-4,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=cli.workers,
        train_sampling_strategy=sampling,
    )
    extra = {"sample_shapes": shapes, "dflop": dflop_settings(strategy, cli)} if strategy in SPLITTER_OF else {}
    trainer = trainer_class(strategy, strategy in PROJECT or strategy in cli.guarded.split(","))(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=collate,
        callbacks=[clock],
        **extra,
    )
    trainer.clock, trainer.visual, trainer.real, trainer.padded = clock, [], 0, 0
    trainer.train()
    if isinstance(trainer, DFLOPTrainer) and trainer.dflop_batch_sampler is not None:
        trainer.dflop_batch_sampler.close()  # max_steps ends mid-epoch: stop its scheduling thread
    timed = clock.steps[1:]
    wall = sum(w for w, _ in timed)
    busy = torch.tensor([b for _, b in timed], dtype=torch.float64)
    everyone = [torch.zeros_like(busy) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, busy)
    per_rank = torch.stack(everyone).numpy()
    imbalance = float(np.mean(per_rank.max(axis=0) / per_rank.mean(axis=0)))
    samples = len(timed) * cli.batch * cli.gas * dist.get_world_size()
    return {
        "step_s": wall / len(timed),
        "forward_s": float(busy.mean()),
        "samples_per_s": samples / wall,
        "padding_efficiency": trainer.real / max(trainer.padded, 1),
        "imbalance": imbalance,
        "mixed_microbatches": mixed_microbatches(trainer.visual),
        "predicted_imbalance": mean_of(trainer.state.log_history, "dflop_predicted_imbalance"),
        "predicted_step_over_bound": mean_of(trainer.state.log_history, "dflop_predicted_step_over_bound"),
        "predicted_step_s": mean_of(trainer.state.log_history, "dflop_predicted_step_s"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--out", "--model", "--data", "--images"):
        parser.add_argument(name, required=True)
    parser.add_argument("--videos", default=None)
    parser.add_argument("--family", choices=("llava", "qwen2_vl"), default="llava")
    parser.add_argument("--cost_model", default=None, help="the profiled cost model (default: the proxy)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--guarded", default="", help="comma-separated baselines run with the blank-image guard")
    parser.add_argument("--deepspeed", default="ds_configs/hf_trainer_zero2.json")
    parser.add_argument("--workers", type=int, default=0, help="the Trainer's dataloader_num_workers")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=-1, help="optimizer steps per run (-1: one epoch)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--gas", type=int, default=2)
    parser.add_argument("--local_rank", type=int, default=0)
    cli = parser.parse_args()
    torch.set_num_threads(1)
    shapes = llava_json_shapes(cli.data, cli.model, image_folder=cli.images, video_folder=cli.videos)
    results = []
    for round_index in range(cli.rounds):
        for strategy in cli.strategies.split(","):
            results.append({"round": round_index, "strategy": strategy, **run(strategy, cli, shapes)})
    if dist.get_rank() == 0:
        Path(cli.out).write_text(json.dumps(results, indent=1))
    finish_rank()


if __name__ == "__main__":
    main()
