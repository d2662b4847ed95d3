"""Trainer scripts as a user writes them (the Dataset over LLaVA JSON and the padded collator of
examples/hf_trainer.py), switched to DFLOP by the documented lines, checked on 2 ranks in one launch:

* ``resume``: ZeRO-2 training stopped after step ``--stop_at`` (checkpoint saved), then a new
  Trainer resumes from that checkpoint to the end of ``--epochs`` epochs; the report lists every
  dataset index fetched, the microbatches of every step, the logged losses and whether each
  microbatch held an image;
* ``sgd``: one SGD step; rank 0 then repeats it in one process on the whole global batch (the
  indices both ranks fetched) from the same initial weights and reports the largest weight
  difference;
* ``example``: examples/hf_trainer.py itself, run for two steps with its command-line options;
* ``adapters``: one epoch of a LoRA model (peft's ``get_peft_model`` before the Trainer, as Trainer
  users wire it) under the ``--deepspeed`` config (ZeRO-3 in the test), ``--bf16`` when given,
  with 3 microbatches per step, so the 28 records end on a shorter step; the report lists every
  dataset index fetched, the microbatches of every step, the engine's ZeRO stage and precision,
  the sampler's seed and how far the LoRA weights moved;
* ``zero3_buckets``: one epoch of full training under the ``--deepspeed`` config (ZeRO-3 with
  buckets below a layer's size in the test, so the vision tower and the LLM meet apart); the
  report lists every dataset index fetched, the microbatches of every step, the engine's ZeRO
  stage and buckets, and the losses.

``--checks`` picks them (default ``resume,sgd,example``). ``--deepspeed none`` leaves
``TrainingArguments.deepspeed`` unset: the config then comes from ``accelerate launch``'s DeepSpeed
plugin. Each rank writes ``--out/rank{r}.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback, TrainingArguments

from dflop_ds.hf_trainer import DFLOPTrainer, llava_json_shapes  # DFLOP: the one import
from dflop_ds.host import SHM_DIR, shm_buffer_name
from dflop_ds.rank_lifecycle import finish_rank

# ---- the user's data code: the example's Dataset and collator, recording what they are asked ----

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py"
_spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
example = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules[_spec.name] = example  # type: ignore[union-attr]  # its dataclass looks itself up there
_spec.loader.exec_module(example)  # type: ignore[union-attr]


class LlavaJsonDataset(example.LlavaJsonDataset):
    """The example's dataset, listing every index fetched."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.fetched: list[int] = []
        self.index_types: set[str] = set()

    def __getitem__(self, index: int) -> dict:
        self.fetched.append(int(index))
        self.index_types.add(type(index).__name__)
        return super().__getitem__(index)


class PadCollator(example.PadCollator):
    """The example's collator, listing each microbatch's rows and whether it held an image."""

    def __init__(self, pad_id: int) -> None:
        super().__init__(pad_id)
        self.had_images: list[bool] = []
        self.rows: list[int] = []

    def __call__(self, items: list[dict]) -> dict:
        batch = super().__call__(items)
        self.had_images.append("pixel_values" in batch)
        self.rows.append(len(items))
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
        deepspeed=None if cli.deepspeed == "none" else cli.deepspeed,
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
    keys = (
        "dflop_predicted_imbalance",
        "dflop_predicted_step_over_bound",
        "dflop_predicted_step_s",
        "dflop_schedule_s",
    )
    return [{k: entry.get(k) for k in keys} for entry in trainer.state.log_history if keys[0] in entry]


def check_resume(cli, processor, out: Path) -> dict:
    args = training_args(cli, out, save_strategy="steps", save_steps=cli.stop_at)
    first, data_a, collator_a, rec_a = trainer_for(cli, args, processor, callbacks_stop_at=cli.stop_at)
    first.train()
    first.dflop_batch_sampler.close()  # stopped mid-epoch: its scheduling thread may be ahead
    checkpoint = out / f"checkpoint-{cli.stop_at}"
    second, data_b, collator_b, rec_b = trainer_for(cli, training_args(cli, out), processor)
    second.train(resume_from_checkpoint=str(checkpoint))
    second.dflop_batch_sampler.close()
    return {
        "fetched_before": data_a.fetched,
        "fetched_after": data_b.fetched,
        "per_step": rec_a.per_step + rec_b.per_step,
        "had_images": collator_a.had_images + collator_b.had_images,
        "losses": losses(second),  # the resumed state's log history holds the first run's entries
        "telemetry": telemetry(second),
        "state_file": (checkpoint / "dflop_sampler.json").is_file(),
        "steps": second.state.global_step,
        "index_types": sorted(data_a.index_types | data_b.index_types),
        "shm_left": own_shm_buffer().exists(),  # unlinked once every rank mapped it, by the Trainer
    }


def own_shm_buffer() -> Path:
    """This rank's DeepSpeed CPU all-reduce buffer in /dev/shm (present only while not unlinked)."""
    env = os.environ
    return SHM_DIR / shm_buffer_name(env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", ""), env.get("RANK", "0"))


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
    trainer.dflop_batch_sampler.close()  # max_steps=1 ends mid-epoch
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


def check_example(cli, out: Path) -> dict:
    """examples/hf_trainer.py as the README runs it, for two steps."""
    argv = [
        "--model_name_or_path", cli.model, "--data_path", cli.data, "--image_folder", cli.images,
        "--deepspeed", cli.deepspeed, "--output_dir", str(out), "--use_cpu", "--max_steps", "2",
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--report_to", "none",
        "--save_strategy", "no", "--logging_steps", "1",
    ]  # fmt: skip
    saved, sys.argv = sys.argv, [str(EXAMPLE), *argv]
    try:
        example.main()
    finally:
        sys.argv = saved
    saved = all((out / name).is_file() for name in ("config.json", "model.safetensors", "processor_config.json"))
    return {"saved": saved}


def start_deepspeed_comm() -> None:
    """Start deepspeed.comm before a ZeRO-3 model is made: under ``use_cpu`` the Trainer starts
    torch.distributed, not deepspeed.comm, so zero.Init would count one rank."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(get_accelerator().communication_backend_name())


def check_adapters(cli, processor, out: Path) -> dict:
    """One epoch of LoRA under the launch's DeepSpeed config, ending on a shorter step."""
    import deepspeed
    from peft import LoraConfig, get_peft_model

    start_deepspeed_comm()
    args = training_args(cli, out, gradient_accumulation_steps=3, num_train_epochs=1, bf16=cli.bf16)
    model = AutoModelForImageTextToText.from_pretrained(cli.model)  # after the arguments: ZeRO-3 partitions it
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(model, lora)
    trainer, dataset, _, recorder = trainer_for(cli, args, processor, model=model)
    trainer.train()
    engine = trainer.model_wrapped
    lora_b = [p for name, p in trainer.model.named_parameters() if "lora_B" in name]  # zeros before training
    with deepspeed.zero.GatheredParameters(lora_b):
        lora_moved = max(float(p.detach().abs().max()) for p in lora_b)
    return {
        "fetched": dataset.fetched,
        "per_step": recorder.per_step,
        "losses": losses(trainer),
        "steps": trainer.state.global_step,
        "zero_stage": int(engine.zero_optimization_stage()),
        "bf16": bool(engine.bfloat16_enabled()),
        "model": type(trainer.model).__name__,
        "seed": trainer.dflop_batch_sampler.sampler.seed,
        "lora_moved": lora_moved,
    }


def check_zero3_buckets(cli, processor, out: Path) -> dict:
    """One epoch under the launch's ZeRO config, as its users train: full parameters, 2 microbatches a step."""
    start_deepspeed_comm()
    args = training_args(cli, out, num_train_epochs=1)
    trainer, dataset, collator, recorder = trainer_for(cli, args, processor)
    trainer.train()
    zero = trainer.model_wrapped._config.zero_config
    return {
        "fetched": dataset.fetched,
        "per_step": recorder.per_step,
        "had_images": collator.had_images,
        "losses": losses(trainer),
        "steps": trainer.state.global_step,
        "zero_stage": int(trainer.model_wrapped.zero_optimization_stage()),
        "buckets": {
            "prefetch": int(zero.prefetch_bucket_size),
            "reduce": int(zero.reduce_bucket_size),
            "persistence": int(zero.param_persistence_threshold),
        },
    }


CHECKS = {"resume": check_resume, "sgd": check_sgd, "adapters": check_adapters, "zero3_buckets": check_zero3_buckets}


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
    parser.add_argument("--checks", default="resume,sgd,example")
    parser.add_argument("--bf16", action="store_true")
    cli = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(cli.out)
    processor = AutoProcessor.from_pretrained(cli.model)
    names = cli.checks.split(",")
    report = {name: CHECKS[name](cli, processor, out / name) for name in names if name != "example"}
    rank = int(os.environ.get("RANK", "0"))
    if "example" in names:  # last: the example ends the rank (finish_rank)
        report["example"] = check_example(cli, out / "example")
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    if "example" not in names:
        finish_rank()


if __name__ == "__main__":
    main()
