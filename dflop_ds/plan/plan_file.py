"""``Plan``: the planner's output, saved as JSON and turned into what DeepSpeed and the sampler read.

A plan holds the chosen layout (encoder and LLM degrees, microbatches per rank, the layer split
of the planned model), the settings it was planned for, and the simulator's predictions. From
it come:

- the stage split of ``MLLMPipelineModule``: :meth:`Plan.stage_bounds` over the flat layer list
  ``encoder layers + projector + LLM layers`` (rescaled when the model has other depths);
- the DeepSpeed config the plan assumed (batch keys, ZeRO stage, precision, activation
  checkpointing, AutoTP, stages): :meth:`Plan.deepspeed_config`;
- the sampler's settings: :meth:`Plan.sampler_settings`, and the ``"dflop"`` block's settings
  (stages, splitter, the activation memory cap per device): :meth:`Plan.dflop_settings`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflop_ds.deepspeed_keys import MIXED_PRECISIONS
from dflop_ds.jsonio import read_json_object, write_json
from dflop_ds.pipe.stage_bounds import StageBounds
from dflop_ds.plan.cluster import PRECISIONS, ZERO_SHARDED
from dflop_ds.plan.layout import Layout, Segment, StageLayers, flat_bounds, stage_layers, stages_from_bounds
from dflop_ds.schedule.splitters import splitter_names

PLAN_FORMAT_VERSION = 2


class PlanFileError(ValueError):
    """A plan file or plan use is invalid (the message names the file or key)."""


def _integer(data: dict[str, Any], key: str) -> int:
    """``data[key]`` as an int; a fraction (``8.7``), a string or a boolean is refused, not truncated."""
    value = data[key]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return value


def splitter_from_dict(data: dict[str, Any]) -> str:
    """The registered splitter a plan or layout dict names: ``"splitter"``, or the files written
    before it existed, whose ``"balanced"`` meant ``"dflop"`` (true) or ``"stock"`` (false)."""
    name = data["splitter"] if "splitter" in data else ("dflop" if data.get("balanced", True) else "stock")
    if name not in splitter_names():
        raise ValueError(f"splitter {name!r} is not registered: choose one of {list(splitter_names())}")
    return str(name)


def _optional_bytes(data: dict[str, Any], key: str) -> float | None:
    """``data[key]`` as a positive number of bytes; absent or null: None (files written before it)."""
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{key} must be a positive number of bytes or null, got {value!r}")
    return float(value)


def _boolean(data: dict[str, Any], key: str) -> bool:
    """``data[key]`` as a bool; anything but true/false is refused."""
    value = data[key]
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def layout_to_dict(layout: Layout) -> dict[str, Any]:
    """A :class:`Layout` as plain JSON data."""
    return {
        "encoder": asdict(layout.encoder),
        "llm": asdict(layout.llm),
        "n_mb": layout.n_mb,
        "stages": [list(s) for s in layout.stages],
        "splitter": layout.splitter,
    }


def layout_from_dict(data: dict[str, Any]) -> Layout:
    """Inverse of :func:`layout_to_dict`."""
    return Layout(
        Segment(**data["encoder"]),
        Segment(**data["llm"]),
        int(data["n_mb"]),
        tuple(stage_layers(s) for s in data["stages"]),
        splitter=splitter_from_dict(data),
    )


@dataclass
class Plan:
    """A parallelism plan.

    Attributes:
        encoder, llm: ``Segment(tp, pp, dp)`` of each model segment.
        n_mb: microbatches per data-parallel rank per step (gradient accumulation steps).
        stages: ``(encoder, projector, llm)`` layer counts of each pipeline stage, for the
            planned model's depths ``layer_counts``.
        layer_counts: ``{"encoder": E, "projector": 1, "llm": L}`` of the planned model.
        global_batch_size: samples per optimizer step.
        gpus, gpus_per_node, gpu_memory_bytes: the cluster planned for.
        splitter: the registered splitter of the microbatches (``"dflop"``: our scheduler,
            ``"stock"``: fixed sample counts); the training config's ``dflop.sampler.kind``.
        family: ``"deepspeed"``, ``"colocated"`` or ``"monolithic"`` (``"separate"`` in older files).
        predicted: the simulator's figures (step time, bubble fraction, memory, speed-ups).
        cost_model: name of the cost model and whether it is analytic (not measured).
        baseline: the monolithic baseline's layout (:func:`layout_to_dict`), for comparisons.
        zero_stage: the DeepSpeed ZeRO stage the memory model assumed (0-3).
        precision: ``"bf16"``, ``"fp16"`` or ``"fp32"``, the precision the memory model assumed.
        activation_checkpointing: whether the cost model's activation memory assumed every
            layer's activations recomputed in backward.
        memory_cap_bytes: the activation bytes one GPU may hold under the plan's memory model (its
            usable memory less the largest stage's model states, in the cost model's tp = 1
            sizes; :func:`dflop_ds.plan.planner.activation_budget`), the run's
            ``dflop.sampler.memory_cap_bytes`` unless its config sets one; None in files written
            before plans recorded it.
        format_version: JSON format version.
    """

    encoder: Segment
    llm: Segment
    n_mb: int
    stages: tuple[StageLayers, ...]
    layer_counts: dict[str, int]
    global_batch_size: int
    gpus: int
    gpus_per_node: int
    gpu_memory_bytes: float
    splitter: str = "dflop"
    family: str = "deepspeed"
    predicted: dict[str, Any] = field(default_factory=dict)
    cost_model: dict[str, Any] = field(default_factory=dict)
    baseline: dict[str, Any] | None = None
    zero_stage: int = 1
    precision: str = "bf16"
    activation_checkpointing: bool = False
    memory_cap_bytes: float | None = None
    format_version: int = PLAN_FORMAT_VERSION

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_layout(
        cls,
        layout: Layout,
        *,
        layer_counts: dict[str, int],
        global_batch_size: int,
        gpus: int,
        gpus_per_node: int,
        gpu_memory_bytes: float,
        family: str,
        predicted: dict[str, Any] | None = None,
        cost_model: dict[str, Any] | None = None,
        zero_stage: int = 1,
        precision: str = "bf16",
        activation_checkpointing: bool = False,
        memory_cap_bytes: float | None = None,
    ) -> Plan:
        """A plan for ``layout`` (see :func:`dflop_ds.plan.make_plans` for plans with predictions)."""
        return cls(
            encoder=layout.encoder,
            llm=layout.llm,
            n_mb=layout.n_mb,
            stages=tuple(layout.stages),
            layer_counts=dict(layer_counts),
            global_batch_size=global_batch_size,
            gpus=gpus,
            gpus_per_node=gpus_per_node,
            gpu_memory_bytes=gpu_memory_bytes,
            splitter=layout.splitter,
            family=family,
            predicted=dict(predicted or {}),
            cost_model=dict(cost_model or {}),
            zero_stage=zero_stage,
            precision=precision,
            activation_checkpointing=activation_checkpointing,
            memory_cap_bytes=memory_cap_bytes,
        )

    @property
    def baseline_layout(self) -> Layout | None:
        """The monolithic baseline's layout, when the plan records one."""
        return None if self.baseline is None else layout_from_dict(self.baseline)

    @property
    def layout(self) -> Layout:
        """The plan's :class:`Layout` (for simulation)."""
        return Layout(
            self.encoder,
            self.llm,
            self.n_mb,
            tuple(self.stages),
            splitter=self.splitter,
            colocated=self.family == "colocated",
        )

    @property
    def deepspeed_compatible(self) -> bool:
        """Stock DeepSpeed runs it as is: encoder and LLM share tp and dp in one pipeline."""
        return self.layout.deepspeed_compatible

    @property
    def pipeline_stages(self) -> int:
        """Stages of the pipeline."""
        return len(self.stages)

    @property
    def dp(self) -> int:
        """Data-parallel degree the sampler splits batches for (the LLM's)."""
        return self.llm.dp

    # -- outputs -----------------------------------------------------------------------------------
    def stage_bounds(
        self, encoder_layers: int | None = None, llm_layers: int | None = None, projector_layers: int | None = None
    ) -> StageBounds:
        """Stage bounds over ``encoder + projector + llm`` layers for a model of these depths.

        With the planned depths (the defaults) the split is exact; for other depths every
        segment's cut points are scaled proportionally (a stage keeps at least one layer).
        """
        E0, P0, L0 = self.layer_counts["encoder"], self.layer_counts["projector"], self.layer_counts["llm"]
        E = E0 if encoder_layers is None else int(encoder_layers)
        P = P0 if projector_layers is None else int(projector_layers)
        L = L0 if llm_layers is None else int(llm_layers)
        if (E, P, L) == (E0, P0, L0):
            return flat_bounds(self.stages)
        if E + P + L < self.pipeline_stages:
            raise PlanFileError(f"a model of {E + P + L} layers cannot fill the plan's {self.pipeline_stages} stages")
        bounds, done = [0], [0, 0, 0]
        for e, p, lm in self.stages[:-1]:
            done = [done[0] + e, done[1] + p, done[2] + lm]
            cut = round(done[0] / E0 * E) + round(done[1] / max(P0, 1) * P) + round(done[2] / L0 * L)
            bounds.append(cut)
        bounds.append(E + P + L)
        for i in range(1, len(bounds)):  # keep every stage non-empty
            bounds[i] = max(bounds[i], bounds[i - 1] + 1)
        for i in range(len(bounds) - 2, 0, -1):
            bounds[i] = min(bounds[i], bounds[i + 1] - 1)
        return StageBounds(bounds, n_layers=E + P + L)

    @property
    def tensor_parallel(self) -> int:
        """Tensor-parallel degree of the LLM (DeepSpeed AutoTP's ``autotp_size``)."""
        return self.llm.tp

    def micro_batch_size(self) -> int:
        """Nominal samples per microbatch: ``global_batch_size // (dp * n_mb)`` (at least 1).

        DeepSpeed never checks it against real microbatches; our sampler's microbatches vary.
        """
        return max(1, self.global_batch_size // (self.dp * self.n_mb))

    def deepspeed_config(self, base: dict[str, Any] | None = None) -> dict[str, Any]:
        """``base`` (a DeepSpeed config dict, not modified) with what the plan assumed set.

        Sets ``zero_optimization.stage``, ``bf16.enabled`` and ``fp16.enabled`` (true for the
        plan's mixed precision, both false for fp32), and the batch keys:
        ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps = n_mb`` and
        ``train_batch_size = micro * n_mb * dp * tp`` (DeepSpeed's identity, which counts every rank:
        under AutoTP it is ``tp`` times the global batch, since the ``tp`` ranks of a group train the
        same samples; without tp it equals the global batch for plans of the search, whose
        ``dp * n_mb`` divides it), ``tensor_parallel.autotp_size = tp`` when
        ``tp > 1`` (the LLM sharded by DeepSpeed AutoTP: HF models only, pp = 1, checked by
        :func:`dflop_ds.setup_checks.check_training_setup`). The ``"dflop"`` block's settings come from
        :meth:`dflop_settings` (:func:`dflop_ds.config.plan_deepspeed_config` writes both).

        Raises:
            PlanFileError: the plan needs separate GPU sets (not runnable on stock DeepSpeed).
        """
        if not self.deepspeed_compatible:
            raise PlanFileError(
                f"plan {self.layout.describe()} puts encoder and LLM on separate GPU sets "
                "(different dp or tp); stock DeepSpeed's topology cannot run it"
            )
        config = json.loads(json.dumps(base or {}))
        micro = self.micro_batch_size()
        config["train_micro_batch_size_per_gpu"] = micro
        config["gradient_accumulation_steps"] = self.n_mb
        config["train_batch_size"] = micro * self.n_mb * self.dp * self.tensor_parallel
        config["zero_optimization"] = {**config.get("zero_optimization", {}), "stage": self.zero_stage}
        for precision in MIXED_PRECISIONS:
            config[precision] = {**config.get(precision, {}), "enabled": precision == self.precision}
        if self.tensor_parallel > 1:
            config["tensor_parallel"] = {**config.get("tensor_parallel", {}), "autotp_size": self.tensor_parallel}
        return config

    def dflop_settings(self) -> dict[str, Any]:
        """The ``"dflop"`` settings the plan decides, by :class:`dflop_ds.config.DFLOPConfig`
        attribute: ``pipeline_stages``, ``stage_bounds``, ``sampler``, ``activation_checkpointing``,
        for a colocated plan ``encoder`` (the encoder data-parallel over every rank), and for a plan
        of the DFLOP sampler that records one, ``memory_cap_bytes`` (the other samplers take no cap)."""
        settings: dict[str, Any] = {
            "pipeline_stages": self.pipeline_stages,
            "stage_bounds": self.stage_bounds().to_list(),
            "sampler": self.splitter,
            "activation_checkpointing": self.activation_checkpointing,
        }
        if self.layout.colocated:
            settings["encoder"] = "colocated"
        if self.memory_cap_bytes is not None and self.splitter == "dflop":
            settings["memory_cap_bytes"] = self.memory_cap_bytes
        return settings

    def sampler_settings(self) -> dict[str, int]:
        """What the batch sampler needs: ``global_batch_size``, ``dp``, ``n_mb``."""
        return {"global_batch_size": self.global_batch_size, "dp": self.dp, "n_mb": self.n_mb}

    def world_size(self) -> int:
        """GPUs (processes) the plan occupies."""
        return self.layout.gpus

    # -- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (with ``format_version`` and ``deepspeed_compatible``)."""
        data = asdict(self)
        data["stages"] = [list(s) for s in self.stages]
        data["deepspeed_compatible"] = self.deepspeed_compatible
        data["stage_bounds"] = self.stage_bounds().to_list()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "plan") -> Plan:
        """Inverse of :meth:`to_dict`; errors name ``source`` and the key at fault."""
        version = data.get("format_version")
        if version != PLAN_FORMAT_VERSION:
            raise PlanFileError(
                f"{source}: format_version {version!r} is not supported (expected {PLAN_FORMAT_VERSION})"
            )
        try:
            plan = cls(
                encoder=Segment(**data["encoder"]),
                llm=Segment(**data["llm"]),
                n_mb=_integer(data, "n_mb"),
                stages=tuple(stage_layers(s) for s in data["stages"]),
                layer_counts={k: int(v) for k, v in data["layer_counts"].items()},
                global_batch_size=_integer(data, "global_batch_size"),
                gpus=_integer(data, "gpus"),
                gpus_per_node=_integer(data, "gpus_per_node"),
                gpu_memory_bytes=float(data["gpu_memory_bytes"]),
                splitter=splitter_from_dict(data),
                family=str(data.get("family", "deepspeed")),
                predicted=dict(data.get("predicted", {})),
                cost_model=dict(data.get("cost_model", {})),
                baseline=data.get("baseline"),
                zero_stage=_integer(data, "zero_stage"),
                precision=str(data["precision"]),
                activation_checkpointing=_boolean(data, "activation_checkpointing"),
                memory_cap_bytes=_optional_bytes(data, "memory_cap_bytes"),
            )
            if plan.baseline is not None:
                layout_from_dict(plan.baseline)
        except KeyError as error:
            raise PlanFileError(f"{source}: missing key {error.args[0]!r}") from None
        except (TypeError, ValueError) as error:
            raise PlanFileError(f"{source}: bad value: {error}") from None
        plan.validate(source)
        return plan

    def validate(self, source: str = "plan") -> None:
        """Check internal consistency; raise :class:`PlanFileError` naming the problem."""
        for key in ("encoder", "projector", "llm"):
            if key not in self.layer_counts:
                raise PlanFileError(f"{source}: layer_counts lacks {key!r}")
        totals = [sum(s[i] for s in self.stages) for i in range(3)]
        want = [self.layer_counts["encoder"], self.layer_counts["projector"], self.layer_counts["llm"]]
        if totals != want:
            raise PlanFileError(
                f"{source}: stages hold {totals} (encoder, projector, llm) layers, layer_counts say {want}"
            )
        if any(sum(s) == 0 for s in self.stages):
            raise PlanFileError(f"{source}: a stage holds no layers: {list(self.stages)}")
        stages_from_bounds(flat_bounds(self.stages), *want)
        if self.n_mb < 1 or self.global_batch_size < self.dp * self.n_mb:
            raise PlanFileError(
                f"{source}: global_batch_size={self.global_batch_size} "
                f"cannot fill n_mb={self.n_mb} microbatches on dp={self.dp} ranks"
            )
        if self.global_batch_size % (self.dp * self.n_mb):
            raise PlanFileError(
                f"{source}: global_batch_size={self.global_batch_size} is not a multiple of dp={self.dp} x"
                f" n_mb={self.n_mb} = {self.dp * self.n_mb}: DeepSpeed's train_batch_size (micro x n_mb x dp)"
                f" would become {self.micro_batch_size() * self.dp * self.n_mb}, not the planned batch"
            )
        if self.layout.gpus != self.gpus:  # a hand-edited gpus would otherwise be ignored
            raise PlanFileError(
                f"{source}: gpus is {self.gpus}, but the plan's layout uses {self.layout.gpus} GPUs: re-plan"
                " with --gpus instead of editing the plan"
            )
        if self.zero_stage not in ZERO_SHARDED or self.precision not in PRECISIONS:
            raise PlanFileError(
                f"{source}: zero_stage={self.zero_stage!r} / precision={self.precision!r}: expected"
                f" one of {sorted(ZERO_SHARDED)} / {PRECISIONS}"
            )
        if self.memory_cap_bytes is not None and not 0 < self.memory_cap_bytes < math.inf:
            raise PlanFileError(
                f"{source}: memory_cap_bytes={self.memory_cap_bytes!r} must be a positive number of bytes"
            )
        reason = self.unrunnable_reason()
        if reason is not None:
            raise PlanFileError(f"{source}: {reason}")

    def unrunnable_reason(self) -> str | None:
        """Why DeepSpeed cannot run this plan's ZeRO stage (None: it can): its pipeline engine runs
        ZeRO stages 0 and 1 only."""
        if self.pipeline_stages > 1 and self.zero_stage > 1:
            return (
                f"ZeRO stage {self.zero_stage} with {self.pipeline_stages} pipeline stages: DeepSpeed's pipeline"
                " engine runs ZeRO stages 0 and 1 only"
            )
        return None

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON (refused, naming the reason, if :meth:`validate` fails)."""
        self.validate(str(path))
        write_json(path, self.to_dict(), indent=2)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`save`."""
        return cls.from_dict(read_json_object(path, PlanFileError), source=str(path))
