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

from importlib import import_module
from typing import Any

#: public name -> the module that defines it; imported on first use, so that the composition root
#: (dflop_ds.compose) can use this package's light modules (the sampler, the agreement) while the
#: Trainer mixin here uses the composition root
_HOMES = {
    "BlankImageGuardMixin": "dflop_ds.hf_trainer.guard",
    "PaddingFreeCollator": "dflop_ds.hf_trainer.packing",
    "padding_free_collator": "dflop_ds.hf_trainer.packing",
    "use_segment_attention": "dflop_ds.hf_trainer.packing",
    "ShapeTable": "dflop_ds.hf_trainer.shapes",
    "hf_dataset_shapes": "dflop_ds.hf_trainer.shapes",
    "llava_json_shapes": "dflop_ds.hf_trainer.shapes",
    "SAMPLER_STATE": "dflop_ds.hf_trainer.trainer",
    "DFLOPTrainer": "dflop_ds.hf_trainer.trainer",
    "DFLOPTrainerMixin": "dflop_ds.hf_trainer.trainer",
    "dflop_settings": "dflop_ds.hf_trainer.trainer",
    "SUPPORTED": "dflop_ds.hf_trainer.version",
    "check_transformers_version": "dflop_ds.hf_trainer.version",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'dflop_ds.hf_trainer' has no attribute {name!r}")
