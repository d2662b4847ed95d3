"""The ``"dflop"`` block of a DeepSpeed JSON config: dflop-ds settings live beside DeepSpeed's own."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from dflop_ds.data.records import BAD_SAMPLE_POLICIES
from dflop_ds.jsonio import read_json_object


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
        seed: seeds data order and model initialisation.
        steps: optimizer steps to run; warmup_steps of them are left out of throughput figures.
        lr: AdamW learning rate (used when the DeepSpeed config has no "optimizer").
        freeze_encoder: freeze the vision encoder (LLaVA's second stage).
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
    seed: int = 0
    steps: int = 20
    warmup_steps: int = 2
    lr: float = 1e-3
    freeze_encoder: bool = False
    encoder: str = "local"
    model: dict[str, Any] = field(default_factory=dict)
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    resume: bool = False
    telemetry: bool = True
    correction: dict[str, Any] = field(default_factory=dict)
    model_name_or_path: Optional[str] = None
    image_folder: Optional[str] = None
    fault: Optional[dict[str, Any]] = None

    @classmethod
    def from_dict(cls, block: dict[str, Any], source: str = "config") -> "DFLOPConfig":
        """Build from a ``"dflop"`` block; unknown keys and bad values name the key at fault."""
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
        """Raise ``ValueError`` naming the first bad key."""
        checks = {
            "sampler": self.sampler in ("dflop", "stock"),
            "policy": self.policy in ("tiny", "default"),
            "encoder": self.encoder in ("local", "colocated"),
            "pipeline_stages": isinstance(self.pipeline_stages, int) and self.pipeline_stages >= 1,
            "max_samples": self.max_samples is None or self.max_samples >= 1,
            "on_bad_sample": self.on_bad_sample in BAD_SAMPLE_POLICIES,
            "time_limit_s": self.time_limit_s >= 0,
            "ilp_nodes": isinstance(self.ilp_nodes, int) and self.ilp_nodes >= 0,
            "prefetch": isinstance(self.prefetch, int) and self.prefetch >= 0,
            "steps": isinstance(self.steps, int) and self.steps >= 1,
            "warmup_steps": isinstance(self.warmup_steps, int) and 0 <= self.warmup_steps < self.steps,
            "lr": self.lr > 0,
            "checkpoint_every": isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 0,
            "resume": not self.resume or self.checkpoint_dir is not None,
            "stage_bounds": self.stage_bounds is None or len(self.stage_bounds) == self.pipeline_stages + 1,
        }
        for key, ok in checks.items():
            if not ok:
                raise ValueError(f"{source}: \"dflop\".{key} has an invalid value {getattr(self, key)!r}")
        from dflop_ds.schedule.correction import CorrectionSettings
        from dflop_ds.testing.faults import FaultSpec

        if CorrectionSettings.from_dict(self.correction, f"{source}: \"dflop\".correction").enabled and not self.telemetry:
            raise ValueError(f"{source}: \"dflop\".correction needs \"dflop\".telemetry = true")
        FaultSpec.from_dict(self.fault, f"{source}: \"dflop\".fault")


#: DeepSpeed config keys a plan decides.
PLAN_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def fill_from_plan(ds_config: dict[str, Any], block: dict[str, Any], plan: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Copies of a DeepSpeed config and its "dflop" block with what ``plan`` decides filled in.

    The plan supplies the batch keys (:data:`PLAN_BATCH_KEYS`) and the block's
    ``pipeline_stages``, ``stage_bounds`` and ``sampler`` wherever the config leaves them out;
    values the config does set are kept, so a config that contradicts its plan is caught by
    :func:`dflop_ds.checks.check_training_setup` rather than silently overridden.
    """
    planned = plan.deepspeed_config({})
    config = dict(ds_config)
    for key in PLAN_BATCH_KEYS:
        config.setdefault(key, planned[key])
    filled = dict(block)
    for key, value in planned["dflop"].items():
        filled.setdefault(key, value)
    return config, filled
