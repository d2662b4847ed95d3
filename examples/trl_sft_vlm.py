"""TRL's vision-language SFT script, switched to DFLOP's microbatches by the lines marked ``# DFLOP``.

    accelerate launch --config_file examples/accelerate_deepspeed.yaml examples/trl_sft_vlm.py \\
        --dataset_name HuggingFaceH4/llava-instruct-mix-vsft --model_name_or_path MODEL_DIR \\
        --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --output_dir sft-out \\
        --bf16 --max_length None

or ``deepspeed --num_gpus 2 examples/trl_sft_vlm.py --deepspeed ds_configs/hf_trainer_zero2.json ...``.
The dataset is in TRL's vision format (``messages`` and ``images`` columns); the model a LLaVA
whose processor has a chat template. Needs ``pip install 'dflop-ds[trl]'``.
"""

from __future__ import annotations

from datasets import load_dataset
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser, get_peft_config

from dflop_ds.hf_trainer import hf_dataset_shapes  # DFLOP
from dflop_ds.hf_trainer.sft import DFLOPSFTTrainer  # DFLOP (was: from trl import SFTTrainer)
from dflop_ds.rank_lifecycle import finish_rank  # DFLOP: a clean end of every rank


def main() -> None:
    script_args, training_args, model_args = TrlParser(
        (ScriptArguments, SFTConfig, ModelConfig)
    ).parse_args_and_config()
    training_args.remove_unused_columns = False  # the vision collator reads the raw columns
    processor = AutoProcessor.from_pretrained(
        model_args.model_name_or_path, trust_remote_code=model_args.trust_remote_code
    )
    model = AutoModelForImageTextToText.from_pretrained(
        model_args.model_name_or_path, trust_remote_code=model_args.trust_remote_code, dtype=model_args.dtype
    )
    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    train = dataset[script_args.dataset_train_split]
    trainer = DFLOPSFTTrainer(  # DFLOP (was: SFTTrainer)
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        processing_class=processor,
        peft_config=get_peft_config(model_args),
        sample_shapes=hf_dataset_shapes(train, processor),  # DFLOP: shapes from the chat template and image headers
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    finish_rank(trainer.dflop_batch_sampler)  # DFLOP: stop the scheduling thread and the process group


if __name__ == "__main__":
    main()
