"""dflop_ds.models.hf: HuggingFace multimodal models on the pipeline and ZeRO engines.

:mod:`~dflop_ds.models.hf.registry` holds the model families by ``config.model_type``; each family
is one folder (``llava/``, ``qwen2_vl/``, ``llava_onevision/``, ``internvl/``) holding its adapter
(``model``), data pipeline (``data``), shape rules (``shapes``), synthetic microbatches
(``synthetic``) and its registry record (``family``). What families share lives in ``base/`` (the
template preprocessor, the media dataset and collates, layer wrappers, packed attention); no family
imports another. Family-neutral services over the registry: ``preprocessor``, ``training`` (the
training-loop source of a family), ``profile``, ``check`` (``dflop-ds check-model``), ``lora``.
Import the submodules directly: transformers is imported only when they need it, so
``import dflop_ds`` works without it.
"""
