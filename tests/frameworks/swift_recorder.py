"""A test plugin for ``swift sft`` (``--external_plugins THIS --callbacks dflop record``): lists the
dataset index of every training row ms-swift's dataset is asked for, per rank, and stops training
after ``DFLOP_STOP_AT`` steps with a checkpoint (a kill between two steps).

The list is written to ``$DFLOP_FETCH_LOG.rank{R}`` as JSON lines ``{"step": s, "index": i}``;
only fetches after training begins count (ms-swift prints row 0 before).
"""

import json
import os

from swift.callbacks import TrainerCallback, callbacks_map
from swift.dataset import LazyLLMDataset

_state = {"training": False, "step": 0}
_original = LazyLLMDataset.__getitem__


def _recording_getitem(self, idx):
    if _state["training"] and not isinstance(idx, str):
        rank = os.environ.get("RANK", "0")
        with open(f"{os.environ['DFLOP_FETCH_LOG']}.rank{rank}", "a") as log:
            log.write(json.dumps({"step": _state["step"], "index": int(idx)}) + "\n")
    return _original(self, idx)


LazyLLMDataset.__getitem__ = _recording_getitem


class RecordCallback(TrainerCallback):
    """Turns recording on at the start of training; stops after ``DFLOP_STOP_AT`` steps."""

    def on_train_begin(self, args, state, control, **kwargs):
        _state.update(training=True, step=state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        _state["step"] = state.global_step
        stop = int(os.environ.get("DFLOP_STOP_AT", "0"))
        if stop and state.global_step >= stop:
            control.should_training_stop = True
            control.should_save = True


callbacks_map["record"] = RecordCallback
