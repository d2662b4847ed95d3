"""The ``"dflop"`` block of a DeepSpeed JSON config, parsed once into typed sections.

dflop-ds settings live beside DeepSpeed's own keys (which :mod:`dflop_ds.deepspeed_keys` reads).
:meth:`DFLOPConfig.from_dict` reads the block once into one frozen dataclass per section, whose
attributes are the section's JSON keys: ``cfg.sampler.kind`` is ``dflop.sampler.kind``,
``cfg.model.lora`` the parsed ``dflop.model.lora``. Code that writes a block names a setting by
its *setting name* (:func:`set_settings`, :func:`get_setting`, :meth:`DFLOPConfig.path`): the key,
or where keys of two sections would clash, the name :func:`setting` gives (``sampler`` for
``dflop.sampler.kind``, ``plan`` for ``dflop.plan.file``).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflop_ds.data.records import BAD_SAMPLE_POLICIES
from dflop_ds.data.video import DEFAULT_VIDEO_FPS, DEFAULT_VIDEO_MAX_FRAMES
from dflop_ds.deepspeed_keys import BATCH_KEYS, MIXED_PRECISIONS, deepspeed_keys
from dflop_ds.jsonio import read_json_object
from dflop_ds.models.faults import FaultSpec
from dflop_ds.models.hf.lora import LoraSettings
from dflop_ds.schedule.correction import CorrectionSettings
from dflop_ds.schedule.splitters import splitter_names
from dflop_ds.typecheck import check_setting

#: the key of a section that is one setting as a whole (``dflop.correction``)
WHOLE_SECTION = "*"
#: ``dflop.sampler.memory_cap_bytes`` values besides a number: decided for the run (plan, device), none
AUTO, OFF = "auto", "off"


def setting(default: Any, name: str | None = None, **rule: Any) -> Any:
    """A section attribute: its ``default``, its setting ``name`` where it differs from the key,
    and the :func:`~dflop_ds.typecheck.check_setting` ``rule`` its JSON value must pass."""
    metadata = {"name": name, "rule": rule}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class DataSection:
    """``dflop.data``: the dataset and how its records are read.

    Attributes:
        path: dataset path (shape manifest JSONL or LLaVA JSON/JSONL), relative to the working
            directory (setting name ``data``).
        max_samples: use only the first ``max_samples`` samples of the dataset (None: all).
        on_bad_sample: what a bad dataset record does: ``"error"`` (default) stops with a
            message naming the file, record and field; ``"skip"`` drops it, counts it and
            prints the skip report (nothing is dropped silently); a sample whose media then fail
            to load in training trains as a logged stand-in without targets (docs/reliability.md).
        policy: ``"tiny"`` (the bundled tiny model's tiling) or ``"default"`` (LLaVA-OneVision).
        image_folder: folder the dataset records' image paths are relative to (None: the data
            file's folder).
        video_folder: folder the records' video paths are relative to (None: the data file's folder).
        video_fps, video_max_frames: frames sampled per second of a video, and at most this many
            (Qwen2-VL; rounded down to pairs, its temporal patch size).
        max_length: longest token sequence of a HuggingFace model's sample, image tokens included
            (None: the tokenizer's ``model_max_length``); refused, as is ``truncation``, for the tiny model.
        truncation: a longer sample is a bad record (``"error"``) or is cut at ``max_length``
            (``"truncate"``, counted; a cut through image tokens is always a bad record).
        num_workers: DataLoader worker processes per rank (0: load in the training process).
    """

    path: str = setting("examples/data/mixture.jsonl", "data", kind="str", nonempty=True)
    max_samples: int | None = setting(None, kind="int", minimum=1, optional=True)
    on_bad_sample: str = setting("error", kind="str", choices=BAD_SAMPLE_POLICIES)
    policy: str = setting("tiny", kind="str", choices=("tiny", "default"))
    image_folder: str | None = setting(None, kind="str", optional=True, nonempty=True)
    video_folder: str | None = setting(None, kind="str", optional=True, nonempty=True)
    video_fps: float = setting(DEFAULT_VIDEO_FPS, kind="number", minimum=0.01)
    video_max_frames: int = setting(DEFAULT_VIDEO_MAX_FRAMES, kind="int", minimum=2)
    max_length: int | None = setting(None, kind="int", minimum=1, optional=True)
    truncation: str = setting("error", kind="str", choices=("error", "truncate"))
    num_workers: int = setting(2, kind="int", minimum=0)


@dataclass(frozen=True)
class ModelSection:
    """``dflop.model``: which model trains, and how.

    Attributes:
        name_or_path: a HuggingFace ``save_pretrained`` directory to train (None: the tiny
            model; setting name ``model_name_or_path``).
        tiny: overrides of :class:`dflop_ds.models.TinyMLLMConfig` fields (refused with a
            HuggingFace model; setting name ``model``).
        freeze_encoder: freeze the vision encoder (LLaVA's second stage).
        activation_checkpointing: recompute every layer's activations in backward instead of
            keeping them (less memory, about a third more compute); a plan sets it to what its
            memory model assumed.
        encoder: where a sample's tiles are encoded: ``"local"`` (default; on the rank that
            trains it) or ``"colocated"`` (dispatched by predicted cost over all ranks, features
            exchanged; either engine for the tiny model, the plain engine (with or without
            AutoTP) for LLaVA, see :mod:`dflop_ds.train.colocated`).
        packing: pack each microbatch's samples into one sequence (attention kept inside each
            sample; :mod:`dflop_ds.models.packing`) instead of padding them to the longest, and
            balance on the additive packed cost (:class:`dflop_ds.cost.PackedCost`).
            None (default): on where the model supports it (the tiny model and every registered
            HF family; measured faster on the tiny model, HF LLaVA and Qwen2-VL, see
            docs/configuration.md), off otherwise; true for a model without packing is refused.
        lora: LoRA fine-tuning of a HuggingFace model's language model
            (:class:`~dflop_ds.models.hf.lora.LoraSettings`, written e.g. ``{"r": 8, "alpha": 16}``);
            None trains every weight.
    """

    name_or_path: str | None = setting(None, "model_name_or_path", kind="str", optional=True, nonempty=True)
    tiny: dict[str, Any] = setting({}, "model", kind="dict")
    freeze_encoder: bool = setting(False, kind="bool")
    activation_checkpointing: bool = setting(False, kind="bool")
    encoder: str = setting("local", kind="str", choices=("local", "colocated"))
    packing: bool | None = setting(None, kind="bool", optional=True)
    lora: LoraSettings | None = setting(None, kind="dict", optional=True)


@dataclass(frozen=True)
class SamplerSection:
    """``dflop.sampler``: how each global batch is split into microbatches.

    Attributes:
        kind: a registered splitter (:mod:`dflop_ds.schedule.splitters`): ``"dflop"``
            (balanced microbatches), ``"stock"`` (fixed sample count), ``"llava"``, ``"verl"``,
            ``"batch_rebalance"`` (transformers'; ``"batch_rebalance_text"`` on LLaVA-1.5's
            placeholder lengths), ``"llamafactory_packing"``, ``"swift_packing"``; setting
            name ``sampler``.
        cost_model: a cost-model JSON (:func:`dflop_ds.cost.load_cost_model`; None: the unitless proxy).
        time_limit_s: exact-solver time per global batch (0: no time-limited solve). Time limits
            make splits differ between processes, so they are for single-process runs.
        ilp_nodes: branch-and-bound nodes the exact solver may explore per global batch (0: the
            heuristic alone). Never looks at the clock, so every rank gets the same split.
        prefetch: global batches scheduled ahead in a background thread.
        schedule_timeout_s: the longest training waits for one global batch's schedule before
            stopping with an error naming the epoch and batch (null: forever); an exact solve
            past half of it is abandoned for the heuristic.
        drop_last: drop (and count) each epoch's samples that do not fill a global batch;
            by default they are carried into the next epoch. Every global batch has exactly
            train_batch_size samples either way.
        memory_cap_bytes: the activation bytes one device may hold (its memory beyond the
            parameters, gradients and optimizer states); the DFLOP sampler splits so that no
            microbatch is predicted above it (the cost model's ``predict_memory``, encoder + LLM;
            in a pipeline, stage ``s``'s share of it for each of the microbatches it holds in
            flight, :func:`dflop_ds.cost.stage.stage_memory_caps`). A number of bytes;
            ``"auto"`` (default): the plan's cap when the run follows a plan that records one,
            else :func:`dflop_ds.train.memory_cap.device_activation_budget` of the device's free
            memory (the DFLOP sampler only; the others run without a cap); ``"off"``: no cap.
            A number or ``"off"`` in the config wins over the plan's.
        allow_oversize: a sample predicted above ``memory_cap_bytes`` alone is trained in a
            microbatch of its own, with a warning naming it, instead of stopping with an error.
    """

    kind: str = setting("dflop", "sampler", kind="str", choices=splitter_names())
    cost_model: str | None = setting(None, kind="str", optional=True, nonempty=True)
    time_limit_s: float = setting(0.0, kind="number", minimum=0)
    ilp_nodes: int = setting(0, kind="int", minimum=0)
    prefetch: int = setting(1, kind="int", minimum=0)
    schedule_timeout_s: float | None = setting(300.0, kind="number", above=0, optional=True)
    drop_last: bool = setting(False, kind="bool")
    memory_cap_bytes: float | str = setting(AUTO, kind="number", above=0, words=(AUTO, OFF))
    allow_oversize: bool = setting(False, kind="bool")


@dataclass(frozen=True)
class PlanSection:
    """``dflop.plan``: the plan the run follows, or the stages it sets itself.

    Attributes:
        file: a plan JSON written by ``dflop-ds plan``, relative to the DeepSpeed config's folder
            (:func:`plan_path`; setting name ``plan``); the run is refused unless the DeepSpeed
            config and this block agree with it (``Plan.deepspeed_config`` writes such a config).
        pipeline_stages: pipeline stages; the data-parallel size is world size / stages.
        stage_bounds: layer index bounds of each stage over encoder + projector + LLM layers
            (None: split by predicted layer cost).
    """

    file: str | None = setting(None, "plan", kind="str", optional=True, nonempty=True)
    pipeline_stages: int = setting(2, kind="int", minimum=1)
    stage_bounds: list[int] | None = setting(None, kind="list", optional=True)


@dataclass(frozen=True)
class TrainSection:
    """``dflop.train``: the run's length, optimizer and checkpoints.

    Attributes:
        seed: seeds data order and model initialisation.
        steps: optimizer steps to run; warmup_steps of them are left out of throughput figures.
        lr: AdamW learning rate (used when the DeepSpeed config has no "optimizer").
        checkpoint_dir: where DeepSpeed checkpoints go (None: no checkpoints).
        checkpoint_every: save a checkpoint every this many steps (0: only at the end).
        resume: resume from the latest checkpoint in ``checkpoint_dir`` if there is one.
    """

    seed: int = setting(0, kind="int", minimum=0)
    steps: int = setting(20, kind="int", minimum=1)
    warmup_steps: int = setting(2, kind="int", minimum=0)
    lr: float = setting(1e-3, kind="number", above=0)
    checkpoint_dir: str | None = setting(None, kind="str", optional=True, nonempty=True)
    checkpoint_every: int = setting(0, kind="int", minimum=0)
    resume: bool = setting(False, kind="bool")


@dataclass(frozen=True)
class TelemetrySection:
    """``dflop.telemetry``: ``enabled`` (setting name ``telemetry``) times every pipeline
    instruction and writes per-step telemetry (monitor, log)."""

    enabled: bool = setting(True, "telemetry", kind="bool")


@dataclass(frozen=True)
class TestingSection:
    """``dflop.testing``: ``fault`` injects a slow shape class into the tiny model for tests and
    demos (:class:`~dflop_ds.models.faults.FaultSpec`, written e.g. ``{"min_tiles": 6,
    "seconds_per_tile": 0.01}``); refused with a HuggingFace model."""

    __test__ = False  # not a pytest test class
    fault: FaultSpec | None = setting(None, "fault", kind="dict", optional=True)


#: sections that are one setting as a whole: section -> the rule its JSON value must pass
WHOLE_SECTIONS: dict[str, dict[str, Any]] = {"correction": {"kind": "dict"}}


@dataclass(frozen=True)
class DFLOPConfig:
    """The ``"dflop"`` block of a DeepSpeed config (every key optional), one typed section each.

    Sections (see docs/configuration.md): :class:`DataSection`, :class:`ModelSection` (with its
    ``lora``), :class:`SamplerSection`, :class:`PlanSection`, :class:`TrainSection`,
    :class:`TelemetrySection`, ``correction`` (the adaptive correction's
    :class:`~dflop_ds.schedule.correction.CorrectionSettings`; ``{"enabled": true}`` turns it on
    and needs telemetry) and :class:`TestingSection`. Build it with :meth:`from_dict` (or
    :meth:`from_settings`), which checks every key once.
    """

    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    sampler: SamplerSection = field(default_factory=SamplerSection)
    plan: PlanSection = field(default_factory=PlanSection)
    train: TrainSection = field(default_factory=TrainSection)
    telemetry: TelemetrySection = field(default_factory=TelemetrySection)
    correction: CorrectionSettings = field(default_factory=CorrectionSettings)
    testing: TestingSection = field(default_factory=TestingSection)

    @classmethod
    def path(cls, name: str) -> str:
        """The JSON path of setting ``name`` in the DeepSpeed config, e.g. ``dflop.sampler.kind``."""
        section, key = _location(name)
        return f"dflop.{section}" if key == WHOLE_SECTION else f"dflop.{section}.{key}"

    @classmethod
    def from_dict(cls, block: dict[str, Any], source: str = "config") -> DFLOPConfig:
        """Parse a nested ``"dflop"`` block. An unknown section or key (a flat key of the old format
        too, naming its new path) and a bad value name the key at fault by its full path; a
        ``ValueError`` starts with ``source``."""
        values = _flatten(block, source)
        raw = {name: values[name] if name in values else copy.deepcopy(default) for name, default in _DEFAULTS.items()}
        _check_values(raw, source)
        path = cls.path
        correction = CorrectionSettings.from_dict(raw["correction"], f"{source}: {path('correction')}")
        if correction.enabled and not raw["telemetry"]:
            raise ValueError(f"{source}: {path('correction')} needs {path('telemetry')} = true")
        fault = FaultSpec.from_dict(raw["fault"], f"{source}: {path('fault')}")
        _check_model_kind(raw, source)
        lora = None
        if raw["lora"] is not None:
            if raw["model_name_or_path"] is None:
                raise ValueError(f"{source}: {path('lora')} needs a HuggingFace model (--model_name_or_path)")
            lora = LoraSettings.from_dict(raw["lora"], f"{source}: {path('lora')}")
        parsed = {**raw, "correction": correction, "fault": fault, "lora": lora}
        sections: dict[str, Any] = {}
        for section, keys in _sections().items():
            if WHOLE_SECTION in keys:
                sections[section] = parsed[keys[WHOLE_SECTION]]
            else:
                sections[section] = _SECTION_TYPES[section](**{key: parsed[name] for key, name in keys.items()})
        return cls(**sections)

    @classmethod
    def from_settings(cls, source: str = "config", **settings: Any) -> DFLOPConfig:
        """Parse a block holding ``settings`` (by setting name, as :func:`set_settings` takes them)."""
        return cls.from_dict(set_settings({}, **settings), source=source)

    @classmethod
    def from_deepspeed_config(cls, path: str | Path) -> DFLOPConfig:
        """Read the ``"dflop"`` block of the DeepSpeed JSON config at ``path``."""
        return cls.from_dict(read_json_object(path).get("dflop", {}), source=str(path))


#: section name -> its dataclass (a whole section has none)
_SECTION_TYPES: dict[str, Any] = {
    f.name: f.default_factory for f in dataclasses.fields(DFLOPConfig) if f.name not in WHOLE_SECTIONS
}


def _settings_table() -> dict[str, tuple[str, str, dict[str, Any], Any]]:
    """setting name -> ``(section, key, rule, default JSON value)``, in declaration order."""
    table: dict[str, tuple[str, str, dict[str, Any], Any]] = {}
    for section_field in dataclasses.fields(DFLOPConfig):
        section = section_field.name
        if section in WHOLE_SECTIONS:
            table[section] = (section, WHOLE_SECTION, WHOLE_SECTIONS[section], {})
            continue
        for f in dataclasses.fields(_SECTION_TYPES[section]):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            table[f.metadata["name"] or f.name] = (section, f.name, f.metadata["rule"], default)
    return table


_SETTINGS = _settings_table()
#: setting name -> the value a block that leaves it out has
_DEFAULTS = {name: entry[3] for name, entry in _SETTINGS.items()}


def setting_names() -> list[str]:
    """Every setting name, in the order the sections declare them."""
    return list(_SETTINGS)


def _location(name: str) -> tuple[str, str]:
    """``(section, key)`` of setting ``name``."""
    if name not in _SETTINGS:
        raise KeyError(f"no setting named {name!r}; known: {sorted(_SETTINGS)}")
    section, key, _, _ = _SETTINGS[name]
    return section, key


def _check_values(raw: dict[str, Any], source: str) -> None:
    """Raise ``ValueError`` naming the first bad key of ``raw`` (setting name -> JSON value) by its
    full path and its value: types are strict (a boolean must be true/false, a number must not be a
    string), ranges are checked, then the rules across keys."""
    path = DFLOPConfig.path
    for name, (_, _, rule, _) in _SETTINGS.items():
        try:
            check_setting(path(name), raw[name], **rule)
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from None
    if raw["warmup_steps"] >= raw["steps"]:
        raise ValueError(
            f"{source}: {path('warmup_steps')}={raw['warmup_steps']} must be smaller than"
            f" {path('steps')}={raw['steps']} (steps may come from --steps): warm-up steps are"
            " left out of the throughput figures, so at least one step must remain"
        )
    if raw["resume"] and raw["checkpoint_dir"] is None:
        raise ValueError(f"{source}: {path('resume')}=true needs {path('checkpoint_dir')}")
    bounds, stages = raw["stage_bounds"], raw["pipeline_stages"]
    if bounds is not None and len(bounds) != stages + 1:
        raise ValueError(f"{source}: {path('stage_bounds')} {bounds} needs pipeline_stages + 1 = {stages + 1} entries")


def _check_model_kind(raw: dict[str, Any], source: str) -> None:
    """Refuse, by key, settings of the other kind of model than the one trained: the tiny
    model's sizes and fault with a HuggingFace model, a tokenization rule with the tiny model."""
    path = DFLOPConfig.path
    if raw["model_name_or_path"] is not None:
        for name, what in (
            ("model", "sizes of the bundled tiny model"),
            ("fault", "slows the tiny model's encoder"),
        ):
            if raw[name]:
                raise ValueError(
                    f"{source}: {path(name)} ({what}) does not apply to the HuggingFace model"
                    f" {path('model_name_or_path')}={raw['model_name_or_path']!r}: remove it"
                )
    elif raw["max_length"] is not None or raw["truncation"] != "error":
        name = "max_length" if raw["max_length"] is not None else "truncation"
        raise ValueError(
            f"{source}: {path(name)} sets a HuggingFace model's tokenization; the bundled tiny model"
            f" takes its token counts from the data as they are: remove it or set {path('model_name_or_path')}"
        )


def _flatten(block: Any, source: str) -> dict[str, Any]:
    """Setting values (by setting name) from a nested block, refusing unknown sections and keys by full path."""
    if not isinstance(block, dict):
        raise ValueError(f'{source}: the "dflop" block must be an object ({{...}}), got {block!r}')
    sections = _sections()
    values: dict[str, Any] = {}
    for section, content in block.items():
        if section not in sections:
            raise ValueError(f"{source}: {_unknown(section, 'dflop', sorted(sections))}")
        keys = sections[section]
        if WHOLE_SECTION in keys:
            values[keys[WHOLE_SECTION]] = content
            continue
        if not isinstance(content, dict):
            flat = section in _SETTINGS and content is not None  # a value where the old flat key was
            moved = f" (a flat dflop.{section} moved to {DFLOPConfig.path(section)})" if flat else ""
            raise ValueError(
                f"{source}: dflop.{section} must be an object ({{...}}) of {sorted(keys)}, got {content!r}{moved}"
            )
        for key, value in content.items():
            if key not in keys:
                raise ValueError(f"{source}: {_unknown(key, f'dflop.{section}', sorted(keys))}")
            values[keys[key]] = value
    return values


def _unknown(key: str, where: str, known: list[str]) -> str:
    """The message for an unknown ``key`` in ``where``; a key of the flat (old) format names its new path."""
    moved = f"; it moved to {DFLOPConfig.path(key)}" if key in _SETTINGS and where == "dflop" else ""
    return f"unknown key {where}.{key}{moved}; known keys of {where}: {known}"


def _sections() -> dict[str, dict[str, str]]:
    """section -> {JSON key -> setting name} (``WHOLE_SECTION`` for a section that is one setting)."""
    out: dict[str, dict[str, str]] = {}
    for name, (section, key, _, _) in _SETTINGS.items():
        out.setdefault(section, {})[key] = name
    return out


def set_settings(block: dict[str, Any], **settings: Any) -> dict[str, Any]:
    """Put each of ``settings`` (attribute names of :class:`DFLOPConfig`) at its place in the nested
    ``"dflop"`` block ``block`` (modified and returned): the one way code writes the block. A block
    with an unknown or malformed section is refused first, naming it."""
    _flatten(block, 'the "dflop" block')
    for name, value in settings.items():
        section, key = _location(name)
        if key == WHOLE_SECTION:
            block[section] = value
        else:
            block.setdefault(section, {})[key] = value
    return block


def get_setting(block: dict[str, Any], name: str) -> Any:
    """The value of attribute ``name`` in the nested ``"dflop"`` block (None when it is not set)."""
    section, key = _location(name)
    content = block.get(section)
    if key == WHOLE_SECTION or content is None:
        return content
    return content.get(key) if isinstance(content, dict) else None


def plan_path(plan: str, config_path: str | Path) -> str:
    """The plan file a DeepSpeed config at ``config_path`` names as ``dflop.plan.file``: a relative
    path is relative to the config's folder, so the config works from any working directory."""
    return str(Path(config_path).parent / plan)


def plan_reference(plan: str | Path, config_path: str | Path) -> str:
    """What a config written to ``config_path`` stores as ``dflop.plan.file`` for the plan at
    ``plan``: its path relative to the config's folder (read back by :func:`plan_path`)."""
    return os.path.relpath(Path(plan).resolve(), Path(config_path).resolve().parent)


def fill_from_plan(
    ds_config: dict[str, Any], block: dict[str, Any], plan: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Copies of a DeepSpeed config and its "dflop" block with what ``plan`` decides filled in.

    The plan supplies the batch keys (:data:`~dflop_ds.deepspeed_keys.BATCH_KEYS`), ``tensor_parallel``
    (tp > 1), the ZeRO stage and precision (:data:`~dflop_ds.deepspeed_keys.MIXED_PRECISIONS`) its memory
    model assumed, and the block's
    ``pipeline_stages``, ``stage_bounds``, ``activation_checkpointing`` and ``sampler`` wherever the config
    leaves them out, and its ``memory_cap_bytes`` (the activation bytes per device its memory model
    left) where the config leaves it out or sets ``"auto"`` and the sampler is ``"dflop"``;
    values the config does set are kept (a cap the config sets wins over the plan's), so a config
    that contradicts its plan is caught by
    :func:`dflop_ds.setup_checks.check_training_setup` rather than silently overridden; a stage count
    or split, ZeRO stage, precision or checkpointing that contradicts it is refused here, naming both.
    """
    planned = plan.deepspeed_config({})
    settings = plan.dflop_settings()
    for key in ("pipeline_stages", "stage_bounds", "activation_checkpointing"):
        have = get_setting(block, key)
        if have is not None and have != settings[key]:
            raise ValueError(
                f"{DFLOPConfig.path(key)} is {have!r}, but the plan is for {settings[key]!r}:"
                f" leave it out of the config (the plan sets it) or re-plan"
            )
    keys = deepspeed_keys(ds_config)
    zero = keys.zero_stage
    if zero is not None and zero != plan.zero_stage:
        raise ValueError(
            f"zero_optimization.stage is {zero!r}, but the plan's memory model assumed ZeRO stage"
            f" {plan.zero_stage}: leave the stage out of the config (the plan sets it) or re-plan"
        )
    enabled = keys.precisions
    if enabled and enabled != (plan.precision,):
        raise ValueError(
            f"{enabled[0]}.enabled is true, but the plan's memory model assumed {plan.precision}:"
            f" leave the precision out of the config (the plan sets it) or re-plan"
        )
    config = dict(ds_config)
    for key in (*BATCH_KEYS, "tensor_parallel"):
        if key in planned:
            config.setdefault(key, planned[key])
    for key in ("zero_optimization", *MIXED_PRECISIONS):
        config[key] = {
            **planned[key],
            **(config.get(key) or {}),
            **{k: planned[key][k] for k in ("stage", "enabled") if k in planned[key]},
        }
    filled = copy.deepcopy(block)
    unset = {key: value for key, value in settings.items() if get_setting(block, key) is None}
    cap = settings.get("memory_cap_bytes")
    if cap is not None and get_setting(block, "memory_cap_bytes") in (None, AUTO):
        unset["memory_cap_bytes"] = cap  # "auto" asks for the plan's cap; a number or "off" wins
    if (get_setting(block, "sampler") or settings["sampler"]) != "dflop":
        unset.pop("memory_cap_bytes", None)  # only the DFLOP sampler honours a cap
    set_settings(filled, **unset)
    return config, filled


def plan_deepspeed_config(plan: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``base`` (not modified) with what ``plan`` assumed: its DeepSpeed keys
    (:meth:`~dflop_ds.plan.Plan.deepspeed_config`) and its ``"dflop"`` settings
    (:meth:`~dflop_ds.plan.Plan.dflop_settings`) in their sections."""
    config = plan.deepspeed_config(base)
    set_settings(config.setdefault("dflop", {}), **plan.dflop_settings())
    return config
