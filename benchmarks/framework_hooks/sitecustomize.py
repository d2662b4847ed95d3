"""Loaded by every Python process of a `make bench-frameworks` launch (this folder is first on
PYTHONPATH): rank 0 writes the wall-clock time of the Trainer's ``on_train_begin`` and every
``on_step_end`` and ``on_train_end`` to ``$DFLOP_STEP_LOG`` (JSON lines ``{"event", "step", "t"}``),
whichever framework built the Trainer. Model loading, dataset preparation and process start-up
come before ``on_train_begin``, so the times measure training only."""

import json
import os
import time

if os.environ.get("DFLOP_STEP_LOG"):
    from transformers import trainer_callback

    def _record(event, state):
        if os.environ.get("RANK", "0") == "0":
            with open(os.environ["DFLOP_STEP_LOG"], "a") as log:
                log.write(json.dumps({"event": event, "step": state.global_step, "t": time.perf_counter()}) + "\n")

    def _wrap(name):
        original = getattr(trainer_callback.CallbackHandler, name)

        def hook(self, args, state, control, **kwargs):
            _record(name, state)
            return original(self, args, state, control, **kwargs)

        setattr(trainer_callback.CallbackHandler, name, hook)

    for _name in ("on_train_begin", "on_step_end", "on_train_end"):
        _wrap(_name)
