"""A Trainer script as a user writes one (its own Dataset over LLaVA JSON, its own padded collator),
switched to DFLOP by the documented lines, and checked on 2 ranks in one launch:

* ``resume``: ZeRO-2 training stopped after step ``--stop_at`` (checkpoint saved), then a new
  Trainer resumes from that checkpoint to the end of ``--epochs`` epochs; the report lists every
  dataset index fetched, the microbatches of every step, the logged losses and whether each
  microbatch held an image;
* ``sgd``: one SGD step; rank 0 then repeats it in one process on the whole global batch (the
  indices both ranks fetched) from the same initial weights and reports the largest weight
  difference.

Each rank writes ``--out/rank{r}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback, TrainingArguments

from dflop_ds.hf_trainer import DFLOPTrainer, llava_json_shapes  # DFLOP: the one import

# ---- the user's data code (nothing DFLOP-specific) -------------------------------------------


class LlavaJsonDataset(torch.utils.data.Dataset):
    """LLaVA JSON records as ``input_ids``, ``labels`` (answers only) and ``pixel_values``."""

    def __init__(self, data_path: str, image_folder: str, processor) -> None:
        self.records = json.loads(Path(data_path).read_text())
        self.image_folder = Path(image_folder)
        self.processor = processor
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict:
        self.fetched.append(int(index))
        record = self.records[index]
        paths = record.get("image", [])
        paths = [paths] if isinstance(paths, str) else paths
        images = [Image.open(self.image_folder / p).convert("RGB") for p in paths]
        tokenizer = self.processor.tokenizer
        ids, labels = [tokenizer.bos_token_id], [-100]
        pixel_values = None
        for turn in record["conversations"]:
            if turn["from"] == "human":
                text = "USER: " + turn["value"] + " ASSISTANT: "
                has = "<image>" in text
                encoded = self.processor(
                    text=text, images=images if has else None, add_special_tokens=False, return_tensors="pt"
                )
                if has:
                    pixel_values = encoded["pixel_values"]
                piece = encoded["input_ids"][0].tolist()
                ids += piece
                labels += [-100] * len(piece)
            else:
                piece = tokenizer(turn["value"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                ids += piece
                labels += piece
        item = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}
        if pixel_values is not None:
            item["pixel_values"] = pixel_values
        return item


class PadCollator:
    """Right-pads a list of items; concatenates their images (the key is left out when none)."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id
        self.had_images: list[bool] = []
        self.rows: list[int] = []

    def __call__(self, items: list[dict]) -> dict:
        length = max(len(item["input_ids"]) for item in items)
        batch = {
            "input_ids": torch.full((len(items), length), self.pad_id),
            "labels": torch.full((len(items), length), -100),
            "attention_mask": torch.zeros((len(items), length), dtype=torch.long),
        }
        for row, item in enumerate(items):
            n = len(item["input_ids"])
            batch["input_ids"][row, :n] = item["input_ids"]
            batch["labels"][row, :n] = item["labels"]
            batch["attention_mask"][row, :n] = 1
        pixels = [item["pixel_values"] for item in items if "pixel_values" in item]
        self.had_images.append(bool(pixels))
        self.rows.append(len(items))
        if pixels:
            batch["pixel_values"] = torch.cat(pixels)
        return batch


class StepRecorder(TrainerCallback):
    """Microbatches collated per optimizer step; stops training after ``stop_at`` steps (a kill)."""

    def __init__(self, collator: PadCollator, stop_at: int | None = None) -> None:
        self.collator = collator
        self.stop_at = stop_at
        self.seen = 0
        self.per_step: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step.append(len(self.collator.had_images) - self.seen)
        self.seen = len(self.collator.had_images)
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_training_stop = True
            control.should_save = True


# ---- the checks ------------------------------------------------------------------------------


def training_args(cli, out: Path, **overrides) -> TrainingArguments:
    options = dict(
        output_dir=str(out),
        use_cpu=True,
        deepspeed=cli.deepspeed,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=5e-3,
        num_train_epochs=cli.epochs,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=cli.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    options.update(overrides)
    return TrainingArguments(**options)


def trainer_for(cli, args, processor, callbacks_stop_at=None, model=None):
    dataset = LlavaJsonDataset(cli.data, cli.images, processor)
    collator = PadCollator(processor.tokenizer.pad_token_id)
    recorder = StepRecorder(collator, callbacks_stop_at)
    shapes = llava_json_shapes(cli.data, cli.model, image_folder=cli.images)  # DFLOP: the shapes line
    model = model or AutoModelForImageTextToText.from_pretrained(cli.model)
    trainer = DFLOPTrainer(  # DFLOP: the class name
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=collator,
        callbacks=[recorder],
        sample_shapes=shapes,  # DFLOP
    )
    return trainer, dataset, collator, recorder


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def telemetry(trainer) -> list[dict]:
    keys = ("dflop_predicted_imbalance", "dflop_schedule_s")
    return [{k: entry[k] for k in keys} for entry in trainer.state.log_history if keys[0] in entry]


def check_resume(cli, processor, out: Path) -> dict:
    args = training_args(cli, out, save_strategy="steps", save_steps=cli.stop_at)
    first, data_a, collator_a, rec_a = trainer_for(cli, args, processor, callbacks_stop_at=cli.stop_at)
    first.train()
    checkpoint = out / f"checkpoint-{cli.stop_at}"
    second, data_b, collator_b, rec_b = trainer_for(cli, training_args(cli, out), processor)
    second.train(resume_from_checkpoint=str(checkpoint))
    return {
        "fetched_before": data_a.fetched,
        "fetched_after": data_b.fetched,
        "per_step": rec_a.per_step + rec_b.per_step,
        "had_images": collator_a.had_images + collator_b.had_images,
        "losses": losses(second),  # the resumed state's log history holds the first run's entries
        "telemetry": telemetry(second),
        "state_file": (checkpoint / "dflop_sampler.json").is_file(),
        "steps": second.state.global_step,
    }


def check_sgd(cli, processor, out: Path) -> dict:
    lr = 0.1
    args = training_args(
        cli,
        out,
        optim="sgd",
        learning_rate=lr,
        max_steps=1,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        per_device_train_batch_size=3,  # a global batch of 12 in 4 microbatches of 3 on average
    )
    trainer, dataset, collator, _ = trainer_for(cli, args, processor)
    trainer.train()
    trained = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}  # ZeRO-2: whole on every rank
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dataset.fetched)
    report: dict = {"fetched": dataset.fetched, "rows": collator.rows}
    if dist.get_rank() == 0:
        reference = AutoModelForImageTextToText.from_pretrained(cli.model)
        initial = {k: v.detach().clone() for k, v in reference.named_parameters()}
        plain = LlavaJsonDataset(cli.data, cli.images, processor)
        batch = PadCollator(processor.tokenizer.pad_token_id)([plain[i] for part in everyone for i in part])
        reference.train()
        reference(**batch).loss.backward()
        with torch.no_grad():
            for p in reference.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
        expected = {k: v.detach() for k, v in reference.named_parameters()}
        name = lambda k: k.removeprefix("module.")  # noqa: E731
        report["max_diff"] = max(float((trained[k] - expected[name(k)]).abs().max()) for k in trained)
        report["max_update"] = max(float((trained[k] - initial[name(k)]).abs().max()) for k in trained)
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--images", required=True)
    parser.add_argument("--deepspeed", default="ds_configs/hf_trainer_zero2.json")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--stop_at", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=0)
    cli = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(cli.out)
    processor = AutoProcessor.from_pretrained(cli.model)
    report = {"resume": check_resume(cli, processor, out / "resume")}
    report["sgd"] = check_sgd(cli, processor, out / "sgd")
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
