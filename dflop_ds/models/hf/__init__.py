"""dflop_ds.models.hf: HuggingFace LLaVA-family models on the pipeline and ZeRO engines.

One module per model family (``llava``) plus shared helpers (``common``; ``packed``: attention
within each sample of a packed microbatch); ``synthetic`` builds
contract microbatches from (prompt, answer, images) for checks and tests; ``check`` compares the
layer lists with the HF model (``dflop-ds check-model``). Import the submodules directly:
transformers is imported only when they need it, so ``import dflop_ds`` works without it.
"""
