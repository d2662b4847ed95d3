"""One versioned JSON format for every cost model: ``save_cost_model`` and ``load_cost_model``.

A file is ``{"format": "dflop-ds-costmodel", "format_version": 3, "kind": ..., "state": ...}``:
``kind`` names the class (:data:`KINDS`), ``state`` is its ``to_dict()``; a packed model nests the
model it wraps as ``"wraps"``. Files of other versions (1 and 2 held fitted models only; analytic
models had a format of their own) are refused with the file and the version named.
"""

from __future__ import annotations

from collections.abc import Callable
from os import PathLike
from pathlib import Path
from typing import Any, Union

from dflop_ds.cost.analytic import AnalyticMLLM, reference_model, reference_names
from dflop_ds.cost.fitted import FittedCostModel
from dflop_ds.cost.packed import PackedCost, RowPackedCost
from dflop_ds.cost.protocol import CostModel
from dflop_ds.cost.proxy import ProxyCost
from dflop_ds.jsonio import read_json_object, write_json

PathArg = Union[str, "PathLike[str]"]
FORMAT = "dflop-ds-costmodel"
#: Version 3: one header for every kind of cost model (2: fitted models with ``shape_policy``).
FORMAT_VERSION = 3
#: The cost-model classes a file may hold, by ``kind``.
KINDS: dict[str, Any] = {cls.kind: cls for cls in (FittedCostModel, AnalyticMLLM, ProxyCost, PackedCost, RowPackedCost)}


def cost_model_to_dict(model: CostModel) -> dict[str, Any]:
    """The JSON-ready file content of ``model``."""
    kind = getattr(model, "kind", None)
    if kind not in KINDS or not isinstance(model, KINDS[kind]):
        raise TypeError(f"cannot save a {type(model).__name__}: cost-model files hold {', '.join(sorted(KINDS))}")
    data: dict[str, Any] = {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": kind}
    if isinstance(model, PackedCost):
        data["wraps"] = cost_model_to_dict(model.cost_model)
    else:
        data["state"] = model.to_dict()
    return data


def cost_model_from_dict(data: Any, source: str = "cost model") -> CostModel:
    """Inverse of :func:`cost_model_to_dict`; another format, version or kind is an error naming ``source``."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        old = isinstance(data, dict) and str(data.get("kind", "")).endswith("AnalyticMLLM")
        version = data.get("format_version") if isinstance(data, dict) else None
        found = f"an analytic cost model of the old format_version {version!r}" if old else "not a dflop-ds cost model"
        raise ValueError(f'{source}: {found} (expected "format": {FORMAT!r}, format_version {FORMAT_VERSION})')
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{source} has cost-model format_version {version!r}, but this dflop-ds reads version {FORMAT_VERSION}:"
            " re-run `dflop-ds profile model` (or save the model again) to rebuild it"
        )
    kind = data.get("kind")
    if kind not in KINDS:
        raise ValueError(f"{source}: unknown cost-model kind {kind!r}; known: {', '.join(sorted(KINDS))}")
    if kind in (PackedCost.kind, RowPackedCost.kind):
        if "wraps" not in data:
            raise ValueError(f'{source}: a packed cost model needs "wraps" (the model it wraps)')
        packed: CostModel = KINDS[kind](cost_model_from_dict(data["wraps"], source))
        return packed
    if not isinstance(data.get("state"), dict):
        raise ValueError(f'{source}: a {kind} cost model needs a "state" object')
    model: CostModel = KINDS[kind].from_dict(data["state"], source=source)
    return model


def save_cost_model(model: CostModel, path: PathArg) -> None:
    """Write ``model`` to ``path`` in the one cost-model format."""
    write_json(Path(path), cost_model_to_dict(model))


def load_cost_model(spec: PathArg) -> CostModel:
    """The cost model in the file ``spec`` (any kind), or the analytic reference model named
    ``spec`` (see :func:`dflop_ds.cost.analytic.reference_names`); errors name the file."""
    if isinstance(spec, str) and spec.lower() in reference_names():
        return reference_model(spec)
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(
            f"cost model {str(spec)!r} is neither a file nor a reference profile ({', '.join(reference_names())})"
        )
    return cost_model_from_dict(read_json_object(path), source=str(path))


def reusable_fitted_model(path: PathArg, log: Callable[[str], None] = print) -> FittedCostModel | None:
    """The fitted cost model in the file ``path``, or None when there is none this version can
    read: no file, a format it refuses, or another kind of model (``log`` says which), so that
    the caller profiles again instead of failing on a stale file."""
    if not Path(path).exists():
        return None
    try:
        model = load_cost_model(path)
    except ValueError as error:
        log(f"{error}: profiling again")
        return None
    if not isinstance(model, FittedCostModel):
        log(f"{path} holds a {type(model).__name__}, not a profiled model: profiling again")
        return None
    return model
