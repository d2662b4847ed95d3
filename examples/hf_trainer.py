"""Fine-tune a HuggingFace LLaVA on LLaVA JSON with ``transformers.Trainer`` and DeepSpeed, DFLOP's
microbatches switched on by the three lines marked ``# DFLOP``.

    deepspeed --num_gpus 2 examples/hf_trainer.py --deepspeed ds_configs/hf_trainer_zero2.json \\
        --model_name_or_path MODEL_DIR --data_path data.json --image_folder images/ \\
        --output_dir trained/ --per_device_train_batch_size 4 --gradient_accumulation_steps 2 \\
        --num_train_epochs 1 --logging_steps 1 --save_steps 100 --bf16

or with accelerate's launcher and a DeepSpeed plugin config (its ``deepspeed_config_file`` replaces
``--deepspeed``)::

    accelerate launch --config_file examples/accelerate_deepspeed.yaml examples/hf_trainer.py \\
        --model_name_or_path MODEL_DIR --data_path data.json --image_folder images/ --output_dir trained/

On a machine without a GPU add ``--use_cpu``, else the Trainer counts one process. Resume after a
kill with ``--resume_from_checkpoint trained/checkpoint-N``. The DeepSpeed config's ``"dflop"``
block picks the sampler (``dflop``, ``stock``, ``llava``, ``verl``) and the cost model; its batch
keys may be ``"auto"`` (filled from these arguments) or numbers equal to them.

Everything but the marked lines is a plain Trainer script: its own Dataset and padded collator.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, HfArgumentParser, TrainingArguments

from dflop_ds.hf_trainer import DFLOPTrainer, llava_json_shapes  # DFLOP (was: from transformers import Trainer)
from dflop_ds.rank_lifecycle import finish_rank  # DFLOP: a clean end of every rank

IGNORE = -100


class LlavaJsonDataset(torch.utils.data.Dataset):
    """LLaVA JSON records as ``input_ids``, ``labels`` (the answers) and ``pixel_values``, in the
    ``USER: ... ASSISTANT: ...`` template; ``<image>`` placeholders are expanded by the processor."""

    def __init__(self, data_path: str, image_folder: str, processor) -> None:
        self.records = json.loads(Path(data_path).read_text())
        self.image_folder = Path(image_folder)
        self.processor = processor

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict:
        record = self.records[index]
        paths = record.get("image", [])
        images = [
            Image.open(self.image_folder / p).convert("RGB") for p in ([paths] if isinstance(paths, str) else paths)
        ]
        tokenizer = self.processor.tokenizer
        ids, labels, pixel_values = [tokenizer.bos_token_id], [IGNORE], None
        for turn in record["conversations"]:
            if turn["from"] == "human":
                text = "USER: " + turn["value"] + " ASSISTANT: "
                with_images = "<image>" in text
                encoded = self.processor(
                    text=text, images=images if with_images else None, add_special_tokens=False, return_tensors="pt"
                )
                if with_images:
                    pixel_values = encoded["pixel_values"]
                piece = encoded["input_ids"][0].tolist()
                ids, labels = ids + piece, labels + [IGNORE] * len(piece)
            else:
                piece = tokenizer(turn["value"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                ids, labels = ids + piece, labels + piece
        item = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}
        if pixel_values is not None:
            item["pixel_values"] = pixel_values
        return item


class PadCollator:
    """Right-pads a list of items into one batch; their images are concatenated (no key without images)."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: list[dict]) -> dict:
        rows, length = len(items), max(len(item["input_ids"]) for item in items)
        batch = {
            "input_ids": torch.full((rows, length), self.pad_id),
            "labels": torch.full((rows, length), IGNORE),
            "attention_mask": torch.zeros((rows, length), dtype=torch.long),
        }
        for row, item in enumerate(items):
            n = len(item["input_ids"])
            batch["input_ids"][row, :n] = item["input_ids"]
            batch["labels"][row, :n] = item["labels"]
            batch["attention_mask"][row, :n] = 1
        pixels = [item["pixel_values"] for item in items if "pixel_values" in item]
        if pixels:
            batch["pixel_values"] = torch.cat(pixels)
        return batch


@dataclass
class DataArguments:
    model_name_or_path: str
    data_path: str
    image_folder: str


def main() -> None:
    data_args, args = HfArgumentParser((DataArguments, TrainingArguments)).parse_args_into_dataclasses()
    processor = AutoProcessor.from_pretrained(data_args.model_name_or_path)
    model = AutoModelForImageTextToText.from_pretrained(data_args.model_name_or_path)
    dataset = LlavaJsonDataset(data_args.data_path, data_args.image_folder, processor)
    shapes = llava_json_shapes(  # DFLOP: sample shapes from the records and image headers
        data_args.data_path, data_args.model_name_or_path, image_folder=data_args.image_folder
    )
    trainer = DFLOPTrainer(  # DFLOP (was: Trainer)
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=PadCollator(processor.tokenizer.pad_token_id),
        sample_shapes=shapes,  # DFLOP
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    processor.save_pretrained(args.output_dir)
    finish_rank(trainer.dflop_batch_sampler)  # DFLOP: stop the scheduling thread and the process group


if __name__ == "__main__":
    main()
