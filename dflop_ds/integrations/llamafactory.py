"""DFLOP in LLaMA-Factory: ``dflop-ds llamafactory train config.yaml``.

The command runs LLaMA-Factory's own entry point, ``llamafactory.train.tuner.run_exp``, on the
config, with one change: the supervised fine-tuning workflow builds :class:`DFLOP's
<dflop_ds.hf_trainer.DFLOPTrainerMixin>` subclass of its ``CustomSeq2SeqTrainer``, whose sampler is
DFLOP's (through :mod:`dflop_ds.compose`). Everything else (model loading, template, tokenization,
its multimodal collator, callbacks, saving) is LLaMA-Factory's. What it reads:

* settings: the ``"dflop"`` block of the config's ``deepspeed:`` file (or of the config inline);
* shapes: the tokenized training rows (``input_ids`` less the image tokens LLaMA-Factory expanded,
  ``labels``) and their images' headers; nothing is decoded;
* ``packing``: LLaMA-Factory would pack rows offline (greedy knapsack by length), fixed before
  DFLOP sees them. Under dflop-ds its rows stay one sample each; DFLOP balances each microbatch's
  packed cost (no padding) and packs the microbatch into one row the way LLaMA-Factory's packer
  does (:func:`packed_row`), so LLaMA-Factory's collator, attention and M-RoPE see the rows they
  know. ``per_device_train_batch_size`` is then the samples of one packed row. ``neat_packing``
  is refused for now: rows built for it (sample numbers, packing parameters) failed at the first
  step, their 4-D attention mask longer than the row.

With ``NPROC_PER_NODE`` > 1 or ``FORCE_TORCHRUN=1`` (as ``llamafactory-cli train``) the command
starts ``torchrun`` over this module, one process per rank; each starts DeepSpeed's communication
before the model is loaded (ZeRO-3's ``zero.Init`` would otherwise count one process on CPU) and,
on DeepSpeed releases before 0.19.8 on CPU ranks (LLaMA-Factory 0.9.5 pins ``deepspeed<=0.18.4``),
makes ZeRO-3's gathers wait for every parameter (:mod:`dflop_ds.zero_gather`: without it the
checkpoint loads into partly unwritten memory and the loss is NaN from the first step).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflop_ds.compose import resolve_cost_model, run_settings
from dflop_ds.data import DataError
from dflop_ds.hf_trainer.shapes import ShapeTable
from dflop_ds.hf_trainer.trainer import DFLOPTrainerMixin
from dflop_ds.integrations.chat import media_size
from dflop_ds.models.hf.preprocessor import hf_preprocessor
from dflop_ds.models.tiny_data import IGNORE_INDEX
from dflop_ds.zero_gather import start_ranks_before_loading

#: the media columns of a tokenized row
MEDIA_COLUMNS = ("images", "videos", "audios")


def read_config(path: str | Path) -> dict[str, Any]:
    """The training config (YAML or JSON), as ``llamafactory-cli train`` reads it."""
    import yaml

    text = Path(path).read_text()
    config = yaml.safe_load(text)
    if not isinstance(config, Mapping):
        raise ValueError(f"{path}: not a mapping of LLaMA-Factory options")
    return dict(config)


def check_config(config: Mapping[str, Any], source: str) -> None:
    """Refuse, by option, what DFLOP cannot balance; read the ``"dflop"`` block once so that a bad
    one is named before the model loads."""
    if config.get("neat_packing"):
        raise ValueError(
            f"{source}: neat_packing: true: dflop-ds packs each balanced microbatch as LLaMA-Factory's packing: true"
            " does (samples attend across one row); neat_packing's block-diagonal rows are not supported yet:"
            " use packing: true, or drop both for padded microbatches"
        )
    if config.get("stage", "sft") != "sft":
        raise ValueError(f"{source}: stage: {config['stage']}: dflop-ds llamafactory runs stage: sft only")
    deepspeed = config.get("deepspeed")
    if not deepspeed:
        raise ValueError(f'{source}: no deepspeed: config; its "dflop" block holds DFLOP\'s settings')
    # a file, or the config inline as TrainingArguments.deepspeed takes it (named by ``source``)
    run_settings(None, deepspeed if isinstance(deepspeed, Mapping) else str(deepspeed), f"{source}: deepspeed")


def tokenized_shapes(dataset: Any, model: Any) -> ShapeTable:
    """One shape per row of LLaMA-Factory's tokenized training dataset (``input_ids``, ``labels``,
    ``images``): text tokens are the row's tokens less the image tokens its template expanded,
    image sizes come from the images' headers, under the shape policy of the model's folder."""
    policy = hf_preprocessor(model.name_or_path).policy()
    image_token = int(model.config.image_token_id)
    shapes = []
    columns = [c for c in ("input_ids", "labels", "images", "videos", "audios") if c in dataset.column_names]
    for index, row in enumerate(dataset.select_columns(columns)):
        if row.get("videos") or row.get("audios"):
            raise DataError("has videos or audio, which the framework plugins do not shape yet", sample_id=str(index))
        try:
            sizes = [media_size(image) for image in row.get("images") or []]
        except (OSError, ValueError) as error:
            raise DataError(f"cannot read an image header: {error}", sample_id=str(index), field="images") from error
        ids = row["input_ids"]
        text = sum(1 for token in ids if token != image_token)
        labels = sum(1 for token in row["labels"] if token != IGNORE_INDEX)
        shapes.append(policy.shape(str(index), image_sizes=sizes, text_tokens=text, label_tokens=min(labels, text)))
    return ShapeTable(shapes, policy)


def packed_row(features: list[Mapping[str, Any]], pad_token_id: int, multiple: int = 8) -> dict[str, Any]:
    """One row from a microbatch's tokenized rows, as LLaMA-Factory's packer (``packing: true``)
    builds one: their tokens, labels and media in order, positions restarting at each sample,
    attention mask 1, then padding to a multiple of ``multiple`` tokens (its collator pads to 8 and
    would not pad the positions)."""
    row: dict[str, Any] = {"input_ids": [], "attention_mask": [], "position_ids": [], "labels": []}
    media: dict[str, list[Any]] = {column: [] for column in MEDIA_COLUMNS}
    for feature in features:
        ids = list(feature["input_ids"])
        row["input_ids"] += ids
        row["labels"] += list(feature["labels"])
        row["position_ids"] += list(range(len(ids)))
        for column in MEDIA_COLUMNS:
            media[column] += list(feature.get(column) or [])
    pad = -len(row["input_ids"]) % multiple
    row["input_ids"] += [pad_token_id] * pad
    row["labels"] += [IGNORE_INDEX] * pad
    row["position_ids"] += [0] * pad
    row["attention_mask"] = [1] * len(row["input_ids"])
    row.update({column: items or None for column, items in media.items()})
    return row


class PackedRowCollator:
    """LLaMA-Factory's ``collator`` over one row per microbatch (:func:`packed_row`)."""

    def __init__(self, collator: Any, pad_token_id: int) -> None:
        self.collator, self.pad_token_id = collator, pad_token_id

    def __call__(self, features: list[Mapping[str, Any]]) -> Any:
        return self.collator([packed_row(features, self.pad_token_id)])


def keep_rows_unpacked() -> None:
    """Make LLaMA-Factory tokenize a ``packing`` run's rows one sample each (its supervised
    processor in place of the packed one): dflop-ds packs each balanced microbatch instead."""
    from llamafactory.data import loader
    from llamafactory.data.processor import SupervisedDatasetProcessor

    loader.PackedSupervisedDatasetProcessor = SupervisedDatasetProcessor


def forward_takes_loss_kwargs(model: Any) -> bool:
    """Whether ``model``'s forward passes extra keywords (``num_items_in_batch``) to its loss."""
    parameters = inspect.signature(model.forward).parameters.values()
    return any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters)


def dflop_trainer_class(base: type, packing: bool = False) -> type:
    """``base`` (LLaMA-Factory's ``CustomSeq2SeqTrainer``) with DFLOP's sampler, its shapes read
    from the training dataset it is given; ``packing``: each microbatch is packed into one row
    (:class:`PackedRowCollator`) and balanced on its packed cost.

    LLaMA-Factory sets ``model_accepts_loss_kwargs = False`` (a workaround for old transformers
    releases), which makes every microbatch's loss its own mean: uneven microbatches would weigh
    their tokens unevenly. Where the model's forward takes the loss keywords, it is set back, so the
    loss is the step's label-token mean over every rank (the Trainer's ``num_items_in_batch``)."""

    def token_weighted_init(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)  # type: ignore[misc]
        if forward_takes_loss_kwargs(self.model):
            self.model_accepts_loss_kwargs = True

    token_weighted = type(f"TokenWeighted{base.__name__}", (base,), {"__init__": token_weighted_init})

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        dataset = kwargs.get("train_dataset")
        shapes = None if dataset is None else tokenized_shapes(dataset, kwargs["model"])
        DFLOPTrainerMixin.__init__(self, *args, sample_shapes=shapes, **kwargs)
        if packing:
            self.data_collator = PackedRowCollator(self.data_collator, self.data_collator.tokenizer.pad_token_id)

    def _dflop_cost_model(self: Any) -> Any:
        """The mixin's cost model, wrapped for microbatches packed into one row when ``packing``
        (one causal mask over the row, as LLaMA-Factory's ``packing`` trains it: row attention)."""
        return resolve_cost_model(self.dflop_settings, self.shape_policy, self.model, packing, row_attention=packing)

    members = {"__init__": __init__, "_dflop_cost_model": _dflop_cost_model}
    return type(f"DFLOP{base.__name__}", (DFLOPTrainerMixin, token_weighted), members)


def train(config_path: str | Path) -> None:
    """Run LLaMA-Factory's ``run_exp`` on ``config_path`` with DFLOP's sampler (in this process)."""
    config = read_config(config_path)
    check_config(config, str(config_path))
    start_ranks_before_loading()
    from llamafactory.train.sft import workflow
    from llamafactory.train.tuner import run_exp

    packing = bool(config.get("packing"))
    if packing:
        keep_rows_unpacked()
    workflow.CustomSeq2SeqTrainer = dflop_trainer_class(workflow.CustomSeq2SeqTrainer, packing)
    run_exp(config)


def launch(config_path: str | Path) -> int:
    """``dflop-ds llamafactory train``: :func:`train` here, or under ``torchrun`` on
    ``NPROC_PER_NODE`` processes when that is above 1 or ``FORCE_TORCHRUN=1`` (as
    ``llamafactory-cli train``); returns the exit status."""
    text = os.environ.get("NPROC_PER_NODE", "1")
    try:
        procs = int(text)
    except ValueError:
        raise ValueError(f"NPROC_PER_NODE={text!r}: expected the number of processes to start (an integer)") from None
    if procs <= 1 and os.environ.get("FORCE_TORCHRUN", "0").lower() not in ("1", "true"):
        train(config_path)
        return 0
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}"]
    command += [f"--nnodes={os.environ.get('NNODES', '1')}", f"--node_rank={os.environ.get('NODE_RANK', '0')}"]
    command += [f"--master_addr={os.environ.get('MASTER_ADDR', '127.0.0.1')}"]
    command += [f"--master_port={os.environ.get('MASTER_PORT', '29517')}"]
    command += ["-m", __name__, str(config_path)]
    return subprocess.run(command).returncode


if __name__ == "__main__":  # one rank under torchrun
    train(sys.argv[1])
