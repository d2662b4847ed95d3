"""examples/train.py with a profile cache of its own on every rank, as on nodes that share none.

    DFLOP_DS_CACHE_PER_RANK=/tmp/caches deepspeed --num_gpus 2 tests/ds_scripts/per_rank_cache_train.py \\
        --deepspeed_config ds_configs/tiny_mllm_pp2.json

Each rank sets ``DFLOP_DS_CACHE`` to ``$DFLOP_DS_CACHE_PER_RANK/rank<RANK>`` (``RANK``: the global
rank the launcher gives it) before training, so the ranks of one machine stand in for the nodes of
a cluster whose caches differ. Used by tests/test_launch_inputs_deepspeed.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dflop_ds.profile.cache import CACHE_ENV
from dflop_ds.train import main

if __name__ == "__main__":
    os.environ[CACHE_ENV] = str(Path(os.environ["DFLOP_DS_CACHE_PER_RANK"]) / f"rank{os.environ['RANK']}")
    sys.exit(main())
