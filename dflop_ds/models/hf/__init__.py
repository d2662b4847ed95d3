"""dflop_ds.models.hf: HuggingFace multimodal models on the pipeline and ZeRO engines.

:mod:`~dflop_ds.models.hf.registry` holds the model families by ``config.model_type``; each family
is one object in its own module (``llava_family``, ``qwen2_vl_family``) over its own files (the
adapter ``llava``, the data pipeline ``llava_data``, synthetic microbatches ``llava_synthetic``, ...).
Shared helpers: ``common``, ``packed`` (attention within each sample of a packed microbatch),
``training`` (the training-loop source of a family), ``check`` (``dflop-ds check-model``).
Import the submodules directly: transformers is imported only when they need it, so
``import dflop_ds`` works without it.
"""
