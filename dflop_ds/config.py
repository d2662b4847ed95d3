"""The ``"dflop"`` block of a DeepSpeed JSON config: dflop-ds settings live beside DeepSpeed's own."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from dflop_ds.data.records import BAD_SAMPLE_POLICIES
from dflop_ds.jsonio import read_json_object
from dflop_ds.typecheck import check_setting


@dataclass
class DFLOPConfig:
    """Settings read from the ``"dflop"`` block of a DeepSpeed config (all optional).

    Attributes:
        sampler: ``"dflop"`` (balanced microbatches) or ``"stock"`` (fixed sample count).
        data: dataset path (shape manifest JSONL or LLaVA JSON/JSONL), relative to the working
            directory.
        max_samples: use only the first ``max_samples`` samples of the dataset (None: all).
        on_bad_sample: what a bad dataset record does: ``"error"`` (default) stops with a
            message naming the file, record and field; ``"skip"`` drops it, counts it and
            prints the skip report (nothing is dropped silently).
        policy: ``"tiny"`` (the bundled tiny model's tiling) or ``"default"`` (LLaVA-OneVision).
        pipeline_stages: pipeline stages; the data-parallel size is world size / stages.
        stage_bounds: layer index bounds of each stage over encoder + projector + LLM layers
            (None: split by predicted layer cost).
        cost_model: a profiled CostModel JSON (None: the unitless proxy).
        plan: a plan JSON written by ``dflop-ds plan``; the run is refused unless the DeepSpeed
            config and this block agree with it (``Plan.deepspeed_config`` writes such a config).
        time_limit_s: exact-solver time per global batch (0: no time-limited solve). Time limits
            make splits differ between processes, so they are for single-process runs.
        ilp_nodes: branch-and-bound nodes the exact solver may explore per global batch (0: the
            heuristic alone). Never looks at the clock, so every rank gets the same split.
        prefetch: global batches scheduled ahead in a background thread.
        num_workers: DataLoader worker processes per rank (0: load in the training process).
        schedule_timeout_s: the longest training waits for one global batch's schedule before
            stopping with an error naming the epoch and batch (null: forever); an exact solve
            past half of it is abandoned for the heuristic.
        drop_last: drop (and count) each epoch's samples that do not fill a global batch;
            by default they are carried into the next epoch. Every global batch has exactly
            train_batch_size samples either way.
        seed: seeds data order and model initialisation.
        steps: optimizer steps to run; warmup_steps of them are left out of throughput figures.
        lr: AdamW learning rate (used when the DeepSpeed config has no "optimizer").
        freeze_encoder: freeze the vision encoder (LLaVA's second stage).
        packing: pack each microbatch's samples into one sequence (attention kept inside each
            sample; :mod:`dflop_ds.models.packing`) instead of padding them to the longest, and
            balance on the additive packed cost (:class:`dflop_ds.profile.packed.PackedCost`).
            None (default): on where the model supports it (the tiny model; measured faster
            there), off otherwise; true for a model without packing is refused.
        encoder: where a sample's tiles are encoded: ``"local"`` (default; on the rank that
            trains it) or ``"colocated"`` (dispatched by predicted cost over all ranks, features
            exchanged; plain engine only, see :mod:`dflop_ds.train.colocated`).
        model: overrides of :class:`dflop_ds.models.TinyMLLMConfig` fields.
        checkpoint_dir: where DeepSpeed checkpoints go (None: no checkpoints).
        checkpoint_every: save a checkpoint every this many steps (0: only at the end).
        resume: resume from the latest checkpoint in ``checkpoint_dir`` if there is one.
        telemetry: time every pipeline instruction and write per-step telemetry (monitor, log).
        correction: adaptive correction settings (see
            :class:`dflop_ds.schedule.correction.CorrectionSettings`; ``{"enabled": true}`` turns
            it on; needs ``telemetry``).
        model_name_or_path: a HuggingFace ``save_pretrained`` directory to train (None: the tiny
            model).
        image_folder: folder the dataset records' image paths are relative to (None: the data
            file's folder).
        video_folder: folder the records' video paths are relative to (None: the data file's folder).
        video_fps, video_max_frames: frames sampled per second of a video, and at most this many
            (Qwen2-VL; rounded down to pairs, its temporal patch size).
        lora: LoRA fine-tuning of a HuggingFace model's language model (see
            :func:`dflop_ds.models.hf.lora.apply_lora`), e.g. ``{"r": 8, "alpha": 16}``; None
            trains every weight.
        max_length: longest token sequence of a HuggingFace model's sample, image tokens included
            (None: the tokenizer's ``model_max_length``).
        truncation: a longer sample is a bad record (``"error"``) or is cut at ``max_length``
            (``"truncate"``, counted; a cut through image tokens is always a bad record).
        fault: inject a slow shape class for tests and demos (see
            :class:`dflop_ds.testing.FaultSpec`), e.g. ``{"min_tiles": 6, "seconds_per_tile": 0.01}``.
    """

    sampler: str = "dflop"
    data: str = "examples/data/mixture.jsonl"
    max_samples: Optional[int] = None
    on_bad_sample: str = "error"
    policy: str = "tiny"
    pipeline_stages: int = 2
    stage_bounds: Optional[list[int]] = None
    cost_model: Optional[str] = None
    plan: Optional[str] = None
    time_limit_s: float = 0.0
    ilp_nodes: int = 0
    prefetch: int = 1
    num_workers: int = 2
    schedule_timeout_s: Optional[float] = 300.0
    drop_last: bool = False
    seed: int = 0
    steps: int = 20
    warmup_steps: int = 2
    lr: float = 1e-3
    freeze_encoder: bool = False
    encoder: str = "local"
    packing: Optional[bool] = None
    model: dict[str, Any] = field(default_factory=dict)
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    resume: bool = False
    telemetry: bool = True
    correction: dict[str, Any] = field(default_factory=dict)
    model_name_or_path: Optional[str] = None
    image_folder: Optional[str] = None
    video_folder: str | None = None
    video_fps: float = 2.0
    video_max_frames: int = 768
    lora: Optional[dict[str, Any]] = None
    max_length: Optional[int] = None
    truncation: str = "error"
    fault: Optional[dict[str, Any]] = None

    @classmethod
    def from_dict(cls, block: dict[str, Any], source: str = "config") -> "DFLOPConfig":
        """Build from a ``"dflop"`` block; unknown keys and bad values name the key at fault."""
        if not isinstance(block, dict):
            raise ValueError(f"{source}: the \"dflop\" block must be an object ({{...}}), got {block!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(block) - known)
        if unknown:
            raise ValueError(f"{source}: unknown key(s) in the \"dflop\" block: {unknown}; known: {sorted(known)}")
        config = cls(**block)
        config.validate(source)
        return config

    @classmethod
    def from_deepspeed_config(cls, path: str | Path) -> "DFLOPConfig":
        """Read the ``"dflop"`` block of the DeepSpeed JSON config at ``path``."""
        return cls.from_dict(read_json_object(path).get("dflop", {}), source=str(path))

    def validate(self, source: str = "config") -> None:
        """Raise ``ValueError`` naming the first bad key and its value: types are strict (a
        boolean must be true/false, a number must not be a string), ranges are checked."""
        rules: dict[str, dict[str, Any]] = {
            "sampler": dict(kind="str", choices=("dflop", "stock")),
            "data": dict(kind="str"),
            "max_samples": dict(kind="int", minimum=1, optional=True),
            "on_bad_sample": dict(kind="str", choices=BAD_SAMPLE_POLICIES),
            "policy": dict(kind="str", choices=("tiny", "default")),
            "encoder": dict(kind="str", choices=("local", "colocated")),
            "packing": dict(kind="bool", optional=True),
            "pipeline_stages": dict(kind="int", minimum=1),
            "stage_bounds": dict(kind="list", optional=True),
            "cost_model": dict(kind="str", optional=True),
            "plan": dict(kind="str", optional=True),
            "time_limit_s": dict(kind="number", minimum=0),
            "ilp_nodes": dict(kind="int", minimum=0),
            "prefetch": dict(kind="int", minimum=0),
            "num_workers": dict(kind="int", minimum=0),
            "schedule_timeout_s": dict(kind="number", above=0, optional=True),
            "drop_last": dict(kind="bool"),
            "seed": dict(kind="int", minimum=0),
            "steps": dict(kind="int", minimum=1),
            "warmup_steps": dict(kind="int", minimum=0),
            "lr": dict(kind="number", above=0),
            "freeze_encoder": dict(kind="bool"),
            "model": dict(kind="dict"),
            "checkpoint_dir": dict(kind="str", optional=True),
            "checkpoint_every": dict(kind="int", minimum=0),
            "resume": dict(kind="bool"),
            "telemetry": dict(kind="bool"),
            "correction": dict(kind="dict"),
            "model_name_or_path": dict(kind="str", optional=True),
            "image_folder": dict(kind="str", optional=True),
            "video_folder": dict(kind="str", optional=True),
            "video_fps": dict(kind="number", minimum=0.01),
            "video_max_frames": dict(kind="int", minimum=2),
            "lora": dict(kind="dict", optional=True),
            "max_length": dict(kind="int", minimum=1, optional=True),
            "truncation": dict(kind="str", choices=("error", "truncate")),
            "fault": dict(kind="dict", optional=True),
        }
        for key, rule in rules.items():
            try:
                check_setting(f"\"dflop\".{key}", getattr(self, key), **rule)
            except ValueError as error:
                raise ValueError(f"{source}: {error}") from None
        if self.warmup_steps >= self.steps:
            raise ValueError(f"{source}: \"dflop\".warmup_steps={self.warmup_steps} must be smaller than"
                             f" \"dflop\".steps={self.steps} (steps may come from --steps): warm-up steps are"
                             " left out of the throughput figures, so at least one step must remain")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError(f"{source}: \"dflop\".resume=true needs \"dflop\".checkpoint_dir")
        if self.stage_bounds is not None and len(self.stage_bounds) != self.pipeline_stages + 1:
            raise ValueError(f"{source}: \"dflop\".stage_bounds {self.stage_bounds} needs pipeline_stages + 1 ="
                             f" {self.pipeline_stages + 1} entries")
        from dflop_ds.schedule.correction import CorrectionSettings
        from dflop_ds.testing.faults import FaultSpec

        if CorrectionSettings.from_dict(self.correction, f"{source}: \"dflop\".correction").enabled and not self.telemetry:
            raise ValueError(f"{source}: \"dflop\".correction needs \"dflop\".telemetry = true")
        FaultSpec.from_dict(self.fault, f"{source}: \"dflop\".fault")
        if self.lora is not None:
            from dflop_ds.models.hf.lora import lora_settings

            if self.model_name_or_path is None:
                raise ValueError(f"{source}: \"dflop\".lora needs a HuggingFace model (--model_name_or_path)")
            lora_settings(self.lora, f"{source}: \"dflop\".lora")


#: DeepSpeed config keys a plan decides.
PLAN_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def autotp_size(ds_config: dict[str, Any]) -> int:
    """The DeepSpeed config's ``tensor_parallel.autotp_size`` (1 without tensor parallelism)."""
    return int((ds_config.get("tensor_parallel") or {}).get("autotp_size", 1) or 1)


def fill_from_plan(ds_config: dict[str, Any], block: dict[str, Any], plan: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Copies of a DeepSpeed config and its "dflop" block with what ``plan`` decides filled in.

    The plan supplies the batch keys (:data:`PLAN_BATCH_KEYS`), ``tensor_parallel`` (tp > 1) and the block's
    ``pipeline_stages``, ``stage_bounds`` and ``sampler`` wherever the config leaves them out;
    values the config does set are kept, so a config that contradicts its plan is caught by
    :func:`dflop_ds.checks.check_training_setup` rather than silently overridden; a stage count
    or split that contradicts it is refused here, naming both.
    """
    planned = plan.deepspeed_config({})
    for key in ("pipeline_stages", "stage_bounds"):
        if block.get(key) is not None and block[key] != planned["dflop"][key]:
            raise ValueError(f"\"dflop\".{key} is {block[key]!r}, but the plan is for {planned['dflop'][key]!r}:"
                             f" leave {key} out of the config (the plan sets it) or re-plan")
    config = dict(ds_config)
    for key in (*PLAN_BATCH_KEYS, "tensor_parallel"):
        if key in planned:
            config.setdefault(key, planned[key])
    filled = dict(block)
    for key, value in planned["dflop"].items():
        filled.setdefault(key, value)
    return config, filled
