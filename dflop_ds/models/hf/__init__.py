"""dflop_ds.models.hf: HuggingFace LLaVA-family models on the pipeline and ZeRO engines.

One module per model family plus shared helpers; ``data`` turns LLaVA JSON records into the
microbatch contract (tokens, labels, pixel values) with the model directory's processor.
Import the submodules directly; transformers is imported only when they need it.
"""
