"""Train an MLLM under DeepSpeed with a dflop-ds sampler: the bundled tiny model or a HuggingFace one.

    deepspeed --num_gpus 2 examples/train.py --deepspeed_config ds_configs/tiny_mllm_pp2.json
    deepspeed --num_gpus 2 examples/train.py --deepspeed_config ds_configs/hf_zero2.json \\
        --model_name_or_path MODEL_DIR --data_path data.json --image_folder images/

The loop itself is :func:`dflop_ds.train.main` (``--help`` lists the options); the config's
"dflop" block chooses the sampler, the data, the engine (``pipeline_stages > 1``: the pipeline
engine, else the plain engine with the config's ZeRO stage) and the stage split. Without a
cost model (``--cost-model``) the tiny model is profiled once per model, machine and software
versions and the profile reused from ``~/.cache/dflop-ds`` (``dflop_ds.profile.cache``).
"""

import sys

from dflop_ds.train import main

if __name__ == "__main__":
    sys.exit(main())
