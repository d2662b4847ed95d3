"""DFLOP in the trainers users already run: ``transformers.Trainer`` (and TRL's, through the mixin).

Change one import and one class name, and add the shapes::

    from dflop_ds.hf_trainer import DFLOPTrainer, llava_json_shapes

    shapes = llava_json_shapes("data.json", "my-llava", image_folder="images/")
    trainer = DFLOPTrainer(model=model, args=args, train_dataset=dataset, data_collator=collate,
                           sample_shapes=shapes)   # the "dflop" block of args.deepspeed, if any

``DFLOPTrainer`` needs transformers (:mod:`dflop_ds.hf_trainer.version` names the tested range).
TRL's ``SFTTrainer``: ``from dflop_ds.hf_trainer.sft import DFLOPSFTTrainer`` with
:func:`hf_dataset_shapes` (``pip install 'dflop-ds[trl]'``). Padding-free microbatches:
``dflop={"model": {"packing": True}}`` (:mod:`dflop_ds.hf_trainer.packing`).
"""

from dflop_ds.hf_trainer.guard import BlankImageGuardMixin
from dflop_ds.hf_trainer.packing import PaddingFreeCollator, padding_free_collator, use_segment_attention
from dflop_ds.hf_trainer.shapes import ShapeTable, hf_dataset_shapes, llava_json_shapes
from dflop_ds.hf_trainer.trainer import SAMPLER_STATE, DFLOPTrainer, DFLOPTrainerMixin, dflop_settings
from dflop_ds.hf_trainer.version import SUPPORTED, check_transformers_version

__all__ = [
    "PaddingFreeCollator",
    "padding_free_collator",
    "use_segment_attention",
    "SAMPLER_STATE",
    "SUPPORTED",
    "BlankImageGuardMixin",
    "ShapeTable",
    "DFLOPTrainer",
    "DFLOPTrainerMixin",
    "check_transformers_version",
    "dflop_settings",
    "hf_dataset_shapes",
    "llava_json_shapes",
]
