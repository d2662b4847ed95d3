"""DFLOP inside the training frameworks multimodal users run: ms-swift (:mod:`.swift`, a plugin
``swift sft`` loads) and LLaMA-Factory (:mod:`.llamafactory`, a launcher around its ``run_exp``).

Each is thin: it reads what its framework built (the DeepSpeed config, the model, the encoded
dataset, the batch sizes) and asks :mod:`dflop_ds.compose` for the sampler. Neither framework is a
dependency of dflop-ds: each module imports its framework when it is used.
"""
