"""The DeepSpeed config a Trainer runs with, from either launcher, and its batch keys.

``deepspeed train.py --deepspeed ds.json`` puts the config in ``TrainingArguments.deepspeed``;
``accelerate launch --config_file accelerate.yaml train.py`` (a DeepSpeed plugin config naming a
``deepspeed_config_file``) hands it to accelerate's DeepSpeed plugin instead, and
``TrainingArguments.deepspeed`` stays None. Either way transformers fills the config's ``"auto"``
keys from ``TrainingArguments`` and records each explicit key that disagrees
(``HfTrainerDeepSpeedConfig.mismatches``), but raises only when it builds the engine, after the
data loader. :func:`check_batch_keys` refuses a disagreeing batch key when the Trainer is built:
the sampler cuts global batches of ``per_device_train_batch_size x gradient_accumulation_steps x
dp``, and DeepSpeed must step the optimizer on the same count.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dflop_ds.deepspeed_keys import BATCH_KEYS

#: the environment variable ``accelerate launch`` names the plugin's DeepSpeed config file in
ACCELERATE_CONFIG_FILE = "ACCELERATE_DEEPSPEED_CONFIG_FILE"


def deepspeed_plugin(trainer: Any) -> Any:
    """The Trainer's accelerate DeepSpeed plugin, or None when DeepSpeed is off."""
    return getattr(trainer.accelerator.state, "deepspeed_plugin", None)


def trainer_deepspeed_config(trainer: Any) -> tuple[Mapping[str, Any] | str | None, str]:
    """``(config, source)``: ``TrainingArguments.deepspeed`` (a path or a dict) when given, else
    the config of accelerate's DeepSpeed plugin (``accelerate launch`` with a DeepSpeed plugin
    config), else ``(None, "defaults")``; ``source`` names where it came from. Where the plugin
    runs (it does for either launcher), its copy is the config: the same keys, with the ``"auto"``
    ones filled as the Trainer trains them (``zero_optimization.stage`` from accelerate's ZeRO stage)."""
    deepspeed = trainer.args.deepspeed
    plugin = deepspeed_plugin(trainer)
    if deepspeed is not None:
        source = "TrainingArguments.deepspeed" if isinstance(deepspeed, Mapping) else str(deepspeed)
        return (deepspeed if plugin is None else plugin.hf_ds_config.config), source
    if plugin is None:
        return None, "defaults"
    path = os.environ.get(ACCELERATE_CONFIG_FILE)
    return plugin.hf_ds_config.config, f"accelerate's DeepSpeed plugin ({ACCELERATE_CONFIG_FILE}={path})"


def batch_key_mismatches(mismatches: list[str]) -> list[str]:
    """The lines of transformers' ``HfTrainerDeepSpeedConfig.mismatches`` (``"- ds KEY=V vs hf
    ARG=W"``) that are about a batch key."""
    return [line for line in mismatches if any(line.startswith(f"- ds {key}=") for key in BATCH_KEYS)]


def check_batch_keys(trainer: Any, source: str) -> None:
    """Refuse, naming both values, a DeepSpeed config (``source``) whose explicit batch keys
    disagree with ``TrainingArguments``; ``"auto"`` keys and DeepSpeed off pass."""
    plugin = deepspeed_plugin(trainer)
    if plugin is None:
        return
    wrong = batch_key_mismatches(list(getattr(plugin.hf_ds_config, "mismatches", [])))
    if wrong:
        raise ValueError(
            f"DFLOPTrainer: the DeepSpeed config {source} disagrees with TrainingArguments on the batch size:\n"
            + "\n".join(wrong)
            + '\nset these keys to "auto" or to the TrainingArguments values (the sampler cuts global batches of'
            " per_device_train_batch_size x gradient_accumulation_steps x data-parallel ranks)"
        )


__all__ = [
    "ACCELERATE_CONFIG_FILE",
    "batch_key_mismatches",
    "check_batch_keys",
    "deepspeed_plugin",
    "trainer_deepspeed_config",
]
