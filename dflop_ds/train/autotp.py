"""DeepSpeed AutoTP over the layer wrappers of a HuggingFace model: the LLM sharded, the vision tower whole.

``deepspeed.initialize`` shards the model it is given when the config has
``"tensor_parallel": {"autotp_size": N}`` (``deepspeed.tp_model_init`` only records arguments
in DeepSpeed 0.19.8). It finds what to shard by the model's HF ``tp_plan`` (patterns over HF
parameter names such as ``model.language_model.layers.*.self_attn.q_proj``) or by a heuristic
over ``nn.ModuleList`` children; neither recognizes a :class:`~dflop_ds.train.sequential.SequentialMLLM`,
whose parameters are named by flat layer index (``"4.layer.self_attn.q_proj.weight"``) and
which holds no ``ModuleList``. :func:`autotp_partition_config` therefore reads the HF model's
own plan with DeepSpeed's converter, finds each wrapped parameter's HF name by identity (the
wrappers share the HF modules), and writes the plan's decision for that exact name as a
``"partition_config"`` (DeepSpeed's custom AutoTP layer specs). The HF plans of LLaVA's text
models cover only ``model.language_model`` and ``lm_head``, so the vision tower and the
projector stay whole (E_tp = 1) while the LLM's linears shard (L_tp = N).

A tied embedding / output head stays replicated (its row-wise embedding plan would make
DeepSpeed compute a vocabulary-parallel loss, which the project's token-normalized loss is not).

Whole parameters whose gradient each rank of a tensor-parallel group computes only in part
(the colocated encoder's: every rank encodes other tiles, see :mod:`dflop_ds.train.colocated`)
are listed in a ``"skip"`` spec with ``grad_allreduce``: DeepSpeed then sums their gradient over
the group as it is computed (a tensor hook, before ZeRO reduces it over the data-parallel ranks).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from dflop_ds.deepspeed_keys import deepspeed_keys

#: HF tp_plan styles DeepSpeed would turn into a vocabulary-parallel embedding (kept whole here)
_EMBEDDING_STYLES = ("embedding_rowwise",)


def is_tensor_parallel_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a layer DeepSpeed AutoTP put in place of a whole one (e.g. ``LinearLayer``)."""
    return type(module).__module__.startswith("deepspeed.module_inject")


def hf_tp_plan(hf_model: nn.Module) -> dict[str, str]:
    """The HF model's tensor-parallel plan as DeepSpeed reads it (pattern -> style); raises
    ``ValueError`` naming the model class when it has none (AutoTP could not shard it exactly)."""
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan

    plan = _get_hf_tp_plan(hf_model)
    if not plan:
        raise ValueError(
            f"{type(hf_model).__name__} declares no HuggingFace tp_plan: DeepSpeed AutoTP has no "
            "tensor-parallel layout for it; train it with tensor_parallel.autotp_size = 1"
        )
    return plan


def autotp_partition_config(
    hf_model: nn.Module, module: nn.Module, *, sum_gradients: Sequence[str] = ()
) -> dict[str, Any]:
    """DeepSpeed ``tensor_parallel.partition_config`` that shards ``module``'s parameters as the
    HF model's tp_plan shards the same parameters of ``hf_model`` (shared by identity).

    Parameters the plan leaves out (the vision tower, the projector, norms) match no spec and
    stay whole; embeddings and a head tied to one stay whole too. ``sum_gradients``: names of
    ``module``'s parameters kept whole whose gradients are summed over the tensor-parallel group
    (see the module docstring); they must be ones the plan does not shard.
    """
    from deepspeed.module_inject.autotp_config import AutoTPConfig, PartitionType
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter

    plan = {
        pattern: ("replicated" if style.lower() in _EMBEDDING_STYLES else style)
        for pattern, style in hf_tp_plan(hf_model).items()
    }
    converted = AutoTPConfig(
        layer_specs=TPPlanConverter.convert({p: s for p, s in plan.items() if s != "replicated"}) or []
    )
    hf_names = {id(p): name for name, p in hf_model.named_parameters(remove_duplicate=False)}
    embeddings = {id(m.weight) for m in hf_model.modules() if isinstance(m, nn.Embedding)}
    grouped: dict[tuple[str, bool], list[str]] = {}
    for name, param in module.named_parameters():
        hf_name = hf_names.get(id(param))
        if hf_name is None or id(param) in embeddings:
            continue
        spec = converted.find_matching_spec(hf_name)
        if spec is None or spec.partition_type == PartitionType.SKIP:
            continue
        key = (spec.partition_type.value, bool(spec.gather_output))
        grouped.setdefault(key, []).append("^" + re.escape(name) + "$")
    if not grouped:
        raise ValueError(
            f"{type(hf_model).__name__}: its tp_plan matches none of the trained layers' parameters; "
            "AutoTP would shard nothing"
        )
    specs: list[dict[str, Any]] = [
        {"patterns": patterns, "partition_type": kind, "gather_output": gather}
        for (kind, gather), patterns in sorted(grouped.items())
    ]
    summed = ["^" + re.escape(name) + "$" for name in sum_gradients]
    sharded = {p for spec in specs for p in spec["patterns"]}
    if sharded & set(summed):
        raise ValueError(f"sum_gradients names sharded parameters: {sorted(sharded & set(summed))}")
    if summed:
        specs.append({"patterns": summed, "partition_type": "skip", "grad_allreduce": True})
    return {"use_default_specs": False, "layer_specs": specs}


def with_autotp_layout(
    ds_config: Mapping[str, Any], hf_model: nn.Module | None, module: nn.Module, *, sum_gradients: Sequence[str] = ()
) -> dict:
    """``ds_config`` (copied) with the partition config of :func:`autotp_partition_config` (and its
    ``sum_gradients``) when it asks for ``autotp_size > 1`` and gives no partition config of its
    own; unchanged otherwise.

    Raises ``ValueError`` when tensor parallelism is asked for a model without an HF model
    (the bundled tiny model has no layout AutoTP knows).
    """
    if deepspeed_keys(ds_config).autotp_size <= 1:
        return dict(ds_config)
    if hf_model is None:
        raise ValueError(
            "tensor_parallel.autotp_size > 1 needs a HuggingFace model (model_name_or_path): "
            "AutoTP cannot shard the bundled tiny model"
        )
    tp = dict(ds_config["tensor_parallel"])
    if "partition_config" in tp and sum_gradients:
        raise ValueError(
            "tensor_parallel.partition_config is set: with a colocated encoder dflop-ds writes the "
            "partition config itself (the encoder's gradients are summed over the tensor-parallel "
            "group); remove the key"
        )
    if "partition_config" not in tp:
        tp["partition_config"] = autotp_partition_config(hf_model, module, sum_gradients=sum_gradients)
    return {**ds_config, "tensor_parallel": tp}


__all__ = ["autotp_partition_config", "hf_tp_plan", "is_tensor_parallel_layer", "with_autotp_layout"]
