"""A user's ``DFLOPTrainer`` script on tiny checkpoints of registered families (``--model`` once per
checkpoint, trained one after the other in the same launch), 2 ZeRO-2 ranks, for each checkpoint two
runs on the same items (one in four with an image of the model's, the others
text-only with ``pixel_values=None``, so most microbatches hold no image):

* ``padded``: the user's right-padding collator (the image-free guard on padded microbatches);
* ``packed``: ``dflop={"model": {"packing": True}}`` and no collator: the family's padding-free
  collator, attention within each sample (the guard on padding-free microbatches).

Each run trains ``--steps`` optimizer steps of 2 microbatches of 2 items per rank and reports its
logged losses and whether each microbatch the rank collated held an image; rank ``r`` writes
``--out/rank{r}.json``, ``{model directory: {"padded": ..., "packed": ...}}``.

``--zero3``: under ds_configs/zero3_small_buckets.json instead (every module's parameters gathered
on each call), with one item in three also holding a video (the families whose tower runs apart for
videos: Qwen2-VL's, LLaVA-OneVision's); each run then also reports whether each microbatch held a video.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist
from transformers import AutoModelForImageTextToText, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the family inputs
from family_inputs import RightPadCollator, image_chats  # noqa: E402

from dflop_ds.hf_trainer import DFLOPTrainer  # noqa: E402
from dflop_ds.models.hf.registry import trainer_parts_of  # noqa: E402
from dflop_ds.rank_lifecycle import finish_rank  # noqa: E402
from dflop_ds.shapes import SampleShape  # noqa: E402
from dflop_ds.zero_gather import start_ranks_before_loading  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "ds_configs"


class Recording:
    """A collator that notes whether each microbatch it made held an image."""

    def __init__(self, collate) -> None:
        self.collate = collate
        self.had_images: list[bool] = []
        self.had_videos: list[bool] = []

    def __call__(self, items: list[dict]) -> dict:
        self.had_images.append(any(item.get("pixel_values") is not None for item in items))
        self.had_videos.append(any(item.get("pixel_values_videos") is not None for item in items))
        return self.collate(items)


def run(model_dir: str, out: Path, steps: int, packing: bool, zero3: bool = False) -> tuple[dict, DFLOPTrainer]:
    """One training run: its losses and the media flags of the microbatches this rank collated,
    and the trainer (whose sampler the caller closes)."""
    config = CONFIGS / ("zero3_small_buckets.json" if zero3 else "hf_trainer_zero2.json")
    if zero3:
        start_ranks_before_loading()  # as docs/hf_trainer.md tells ZeRO-3 users on CPU ranks
    args = TrainingArguments(  # before the model: under ZeRO-3 it is made partitioned
        output_dir=str(out),
        use_cpu=True,
        deepspeed=str(config),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=5e-3,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=7,
    )
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    items = image_chats(model.config, 16, every=4, video_every=3 if zero3 else 0)
    table = [
        SampleShape(f"s{i}", text_tokens=len(x["input_ids"]), llm_tokens=len(x["input_ids"]))
        for i, x in enumerate(items)
    ]
    parts = trainer_parts_of(model.config)
    assert parts is not None
    collator = None if packing else RightPadCollator(parts.media_keys, parts.padded_keys)
    trainer = DFLOPTrainer(
        model=model,
        args=args,
        train_dataset=items,
        data_collator=collator,
        sample_shapes=table,
        dflop={"model": {"packing": True}} if packing else None,
    )
    recording = Recording(trainer.data_collator)
    trainer.data_collator = recording
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": losses, "had_images": recording.had_images, "had_videos": recording.had_videos}, trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--zero3", action="store_true", help="ZeRO-3 with buckets below a layer, and videos")
    parser.add_argument("--local_rank", type=int, default=0)  # the DeepSpeed launcher passes it
    cli = parser.parse_args()
    reports, samplers = {}, []
    for index, model in enumerate(cli.model):
        padded, first = run(model, cli.out / f"{index}" / "padded", cli.steps, packing=False, zero3=cli.zero3)
        packed, second = run(model, cli.out / f"{index}" / "packed", cli.steps, packing=True, zero3=cli.zero3)
        reports[model] = {"padded": padded, "packed": packed}
        samplers += [first.dflop_batch_sampler, second.dflop_batch_sampler]
    (cli.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(reports))
    finish_rank(*samplers)


if __name__ == "__main__":
    main()
