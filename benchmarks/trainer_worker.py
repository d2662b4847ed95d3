"""One rank of `make bench-trainer`: the same Trainer script (examples/hf_trainer.py's Dataset and
padded collator) trained with each sampling strategy in turn, round after round, ZeRO-2.

Strategies: ``random`` (the Trainer's default), ``group_by_length`` and ``batch_rebalance``
(transformers' own), each with the blank-image guard (``BlankImageGuardMixin``: unguarded, a
microbatch without images on one rank aborts ZeRO-2's gradient reduction), and ``dflop``
(``DFLOPTrainer``). Each run trains ``--steps`` optimizer steps from the same initial weights;
the first step is left out of the timing. Rank 0 writes ``--out`` (JSON): per round and
strategy, samples/s, padding efficiency (real tokens / padded tokens) and rank imbalance (per
step, the slowest rank's forward time over the mean, averaged over the timed steps).
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

from dflop_ds.hf_trainer import BlankImageGuardMixin, DFLOPTrainer, llava_json_shapes
from dflop_ds.launch import finish_rank

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer.py"
_spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
example = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules[_spec.name] = example  # type: ignore[union-attr]
_spec.loader.exec_module(example)  # type: ignore[union-attr]

STRATEGIES = ("random", "group_by_length", "batch_rebalance", "dflop")


class GuardedTrainer(BlankImageGuardMixin, Trainer):
    """The stock Trainer with only the blank-image guard (a fair baseline under ZeRO-2)."""


class CountingCollator(example.PadCollator):
    """The example's collator, counting real and padded tokens."""

    def __init__(self, pad_id: int) -> None:
        super().__init__(pad_id)
        self.real = self.padded = 0

    def __call__(self, items: list[dict]) -> dict:
        batch = super().__call__(items)
        self.real += int(batch["attention_mask"].sum())
        self.padded += batch["attention_mask"].numel()
        return batch


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
    """Adds each microbatch's forward (loss) time to the clock's busy time."""

    clock: StepClock

    def compute_loss(self, *args, **kwargs):
        start = time.perf_counter()
        loss = super().compute_loss(*args, **kwargs)  # type: ignore[misc]
        self.clock.busy += time.perf_counter() - start
        return loss


def trainer_class(strategy: str) -> type:
    base = DFLOPTrainer if strategy == "dflop" else GuardedTrainer
    return type(f"Timed{base.__name__}", (TimedStep, base), {})


def run(strategy: str, cli, processor, shapes) -> dict:
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(cli.model)
    collator = CountingCollator(processor.tokenizer.pad_token_id)
    clock = StepClock()
    args = TrainingArguments(
        output_dir=str(Path(cli.out).parent / "trainer_runs" / strategy),
        use_cpu=True,
        deepspeed=cli.deepspeed,
        per_device_train_batch_size=cli.batch,
        gradient_accumulation_steps=cli.gas,
        max_steps=cli.steps,
        learning_rate=1e-4,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        train_sampling_strategy="random" if strategy == "dflop" else strategy,
    )
    extra = {"sample_shapes": shapes} if strategy == "dflop" else {}
    trainer = trainer_class(strategy)(
        model=model,
        args=args,
        train_dataset=example.LlavaJsonDataset(cli.data, cli.images, processor),
        data_collator=collator,
        callbacks=[clock],
        **extra,
    )
    trainer.clock = clock
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
        "samples_per_s": samples / wall,
        "padding_efficiency": collator.real / max(collator.padded, 1),
        "imbalance": imbalance,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--out", "--model", "--data", "--images"):
        parser.add_argument(name, required=True)
    parser.add_argument("--deepspeed", default="ds_configs/hf_trainer_zero2.json")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--gas", type=int, default=2)
    parser.add_argument("--local_rank", type=int, default=0)
    cli = parser.parse_args()
    torch.set_num_threads(1)
    processor = AutoProcessor.from_pretrained(cli.model)
    shapes = llava_json_shapes(cli.data, cli.model, image_folder=cli.images)
    results = []
    for round_index in range(cli.rounds):
        for strategy in STRATEGIES:
            results.append({"round": round_index, "strategy": strategy, **run(strategy, cli, processor, shapes)})
    if dist.get_rank() == 0:
        Path(cli.out).write_text(json.dumps(results, indent=1))
    finish_rank()


if __name__ == "__main__":
    main()
