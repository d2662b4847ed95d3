"""Loaded by every Python process of a LLaMA-Factory test run (this folder is put on PYTHONPATH):
lists the dataset index of every training row a data loader fetches, per rank, in
``$DFLOP_FETCH_LOG.rank{R}`` (JSON lines ``{"index": i}``). LLaMA-Factory has no plugin option, and
the run must go through ``dflop-ds llamafactory train`` itself, so the recording hooks in here.
"""

import json
import os

if os.environ.get("DFLOP_FETCH_LOG"):
    import datasets

    _original = datasets.Dataset.__getitems__

    def _recording_getitems(self, keys):
        rank = os.environ.get("RANK", "0")
        with open(f"{os.environ['DFLOP_FETCH_LOG']}.rank{rank}", "a") as log:
            for key in keys:
                log.write(json.dumps({"index": int(key)}) + "\n")
        return _original(self, keys)

    datasets.Dataset.__getitems__ = _recording_getitems
