"""Cost models declare their capabilities; nothing outside dflop_ds/cost/ probes for them.

Every cost model has the flags of :class:`CostModel` (a wrapper forwards its inner model's and
changes only what it changes); :class:`LayeredCostModel` and :class:`PlannerCostModel` say what
the stage split and the planner read. The scan below keeps ``getattr``/``hasattr`` probes for
those names, and cost classes themselves, inside ``dflop_ds/cost/``.
"""

from __future__ import annotations

import ast
import functools
import inspect
from pathlib import Path

import numpy as np
import pytest

from dflop_ds import cost
from dflop_ds.commands.plan import load_planner_model
from dflop_ds.cost import (
    CostModel,
    CostWrapper,
    EncoderScaled,
    EngineScaled,
    FittedCostModel,
    LayeredCostModel,
    LLMOnlyCost,
    PackedCost,
    PackedView,
    PlannerCostModel,
    ProxyCost,
    StageCost,
    memory_blind_model,
    reference_model,
    save_cost_model,
)
from dflop_ds.shapes import SampleShape
from tests.test_costmodel import synthetic_profile

ROOT = Path(__file__).resolve().parents[1]
COST_PACKAGE = ROOT / "dflop_ds" / "cost"
SCANNED = [ROOT / "dflop_ds", ROOT / "benchmarks", ROOT / "examples"]
SHAPES = [
    SampleShape("image", encoder_tiles=5, llm_tokens=110, text_tokens=30),
    SampleShape("text", encoder_tiles=0, llm_tokens=40, text_tokens=40),
]
SHARES = np.array([[1.0, 0.25], [0.0, 0.75]])
FLAGS = ("additive", "per_stage", "memory_per_device", "predicts_memory", "is_analytic")


def protocol_members(protocol: type) -> set[str]:
    """The attribute and method names a protocol declares (its own and its bases')."""
    names: set[str] = set()
    for klass in protocol.__mro__:
        if klass.__module__ == cost.protocol.__name__:
            names |= {n for n in (*vars(klass), *getattr(klass, "__annotations__", {})) if not n.startswith("_")}
    return names


def cost_class_attributes() -> set[str]:
    """Every public attribute a cost class of dflop_ds.cost defines (class attributes, properties, methods)."""
    names: set[str] = set()
    for _, klass in inspect.getmembers(cost, inspect.isclass):
        if klass.__module__.startswith("dflop_ds.cost.") and hasattr(klass, "predict_samples"):
            for base in klass.__mro__[:-1]:
                names |= {n for n in (*vars(base), *getattr(base, "__annotations__", {})) if not n.startswith("_")}
    return names


#: names a probe outside dflop_ds/cost/ may not ask for: what the protocols declare and what cost classes define
CAPABILITY_NAMES = protocol_members(PlannerCostModel) | protocol_members(CostWrapper) | cost_class_attributes()


def scanned_files() -> list[Path]:
    return [path for folder in SCANNED for path in sorted(folder.rglob("*.py")) if COST_PACKAGE not in path.parents]


#: a file without any of these has neither a probe nor a cost class (no need to parse it)
SUSPECT = ("getattr(", "hasattr(", "def predict_")


@functools.cache
def parsed(path: Path) -> ast.Module:
    text = path.read_text()
    return ast.parse(text, filename=str(path)) if any(word in text for word in SUSPECT) else ast.Module([], [])


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if ROOT in path.parents else path.name


def capability_probes(path: Path) -> list[str]:
    """``file:line getattr(x, "name")`` for each getattr/hasattr of a capability name in ``path``."""
    found = []
    for node in ast.walk(parsed(path)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in CAPABILITY_NAMES
        ):
            found.append(f"{shown(path)}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    return found


def cost_classes(path: Path) -> list[str]:
    """``file:line Class`` for each class in ``path`` that predicts costs (a cost model or wrapper)."""
    found = []
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.ClassDef):
            methods = {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
            if methods & {"predict_samples", "predict_microbatch", "predict_memory"}:
                found.append(f"{shown(path)}:{node.lineno} {node.name}")
    return found


def test_the_scan_knows_the_capabilities_and_finds_a_probe(tmp_path):
    for name in (*FLAGS, "layer_shares", "encoder_layers", "forward_fraction", "hidden_bytes_per_token"):
        assert name in CAPABILITY_NAMES, name
    probe = tmp_path / "probe.py"
    probe.write_text("def f(m):\n    return getattr(m, 'additive', False) or hasattr(m, 'layer_shares')\n")
    assert [line.split(" ", 1)[1] for line in capability_probes(probe)] == [
        "getattr(..., 'additive')",
        "hasattr(..., 'layer_shares')",
    ]
    view = tmp_path / "view.py"
    view.write_text("class View:\n    def predict_microbatch(self, shapes):\n        return shapes\n")
    assert [line.split(" ", 1)[1] for line in cost_classes(view)] == ["View"]


def test_no_capability_probe_or_cost_class_outside_the_cost_package():
    files = scanned_files()
    assert files and not any(COST_PACKAGE in path.parents for path in files)
    probes = [probe for path in files for probe in capability_probes(path)]
    assert probes == [], "declare the capability on the cost classes and read it (or isinstance) instead"
    classes = [klass for path in files for klass in cost_classes(path)]
    assert classes == [], "cost models and their wrappers live in dflop_ds/cost/"


@pytest.fixture(scope="module")
def fitted() -> FittedCostModel:
    return FittedCostModel().fit(synthetic_profile())


def flags(model: CostModel) -> dict[str, bool]:
    return {name: bool(getattr(model, name)) for name in FLAGS}


def test_base_models_declare_what_they_are(fitted):
    analytic, proxy = reference_model("llava-ov-0.5b-a100"), ProxyCost()
    padded = {"additive": False, "per_stage": False, "memory_per_device": False, "predicts_memory": True}
    assert flags(fitted) == {**padded, "is_analytic": False}
    assert flags(analytic) == {**padded, "is_analytic": True}
    assert flags(proxy) == {**padded, "is_analytic": False}
    for model in (fitted, analytic):
        assert isinstance(model, PlannerCostModel) and not isinstance(model, CostWrapper)
    assert isinstance(proxy, CostModel) and not isinstance(proxy, LayeredCostModel)
    # what the planner read with a default before: a profiled model's are the old defaults
    assert fitted.name == "FittedCostModel" and fitted.gpu_memory_bytes is None
    assert fitted.encoder_hidden_bytes_per_token == fitted.hidden_bytes_per_token
    assert fitted.forward_fraction == pytest.approx(1 / 3) and not fitted.activation_checkpointing
    np.testing.assert_array_equal(fitted.predict_working_bytes(SHAPES), np.zeros(2))
    assert analytic.forward_fraction == 0.25 and analytic.gpu_memory_bytes == analytic.gpu.memory_bytes
    assert not isinstance(FittedCostModel(), LayeredCostModel), "an unfitted model knows no depths"


def test_wrappers_forward_what_they_do_not_change(fitted):
    analytic = reference_model("llava-ov-0.5b-a100")
    packed, colocated = PackedCost(fitted), LLMOnlyCost(fitted)
    assert flags(packed) == {**flags(fitted), "additive": True}
    assert flags(colocated) == {**flags(fitted), "predicts_memory": False}
    assert LLMOnlyCost(packed).additive and not StageCost(fitted, SHARES).additive
    assert flags(StageCost(packed, SHARES)) == {**flags(packed), "per_stage": True, "memory_per_device": True}
    assert PackedCost(analytic).is_analytic and StageCost(LLMOnlyCost(analytic), SHARES).is_analytic
    chain = PackedCost(colocated)
    assert not chain.predicts_memory and memory_blind_model(chain) is colocated
    with pytest.raises(ValueError, match="LLMOnlyCost predicts no memory"):
        chain.predict_memory(SHAPES)
    for wrapper in (packed, colocated, StageCost(fitted, SHARES), chain):
        assert isinstance(wrapper, CostWrapper) and not isinstance(wrapper, LayeredCostModel)


def test_planner_views_are_planner_models_of_what_they_wrap(fitted):
    analytic = reference_model("llava-ov-0.5b-a100")
    packed = PackedView(analytic)
    assert isinstance(packed, PlannerCostModel) and isinstance(packed, CostWrapper)
    assert packed.additive and not analytic.additive
    assert (packed.name, packed.gpu_memory_bytes, packed.layer_shares) == (
        analytic.name,
        analytic.gpu_memory_bytes,
        analytic.layer_shares,
    )
    np.testing.assert_allclose(
        packed.predict_working_bytes(SHAPES), sum(analytic.predict_working_bytes([s]) for s in SHAPES)
    )
    scaled = EncoderScaled(fitted, 2.0)
    assert scaled.name == "FittedCostModel (encoder time x2)"
    np.testing.assert_allclose(scaled.predict_samples(SHAPES), fitted.predict_samples(SHAPES) * [2.0, 1.0])
    engine = EngineScaled(analytic, [1.5, 1.2], forward_fraction=0.4)
    assert engine.forward_fraction == 0.4 and engine.activation_checkpointing == analytic.activation_checkpointing
    np.testing.assert_allclose(engine.predict_microbatch(SHAPES), analytic.predict_microbatch(SHAPES) * [1.5, 1.2])


def test_planning_commands_refuse_a_model_the_planner_cannot_read(tmp_path):
    path = tmp_path / "proxy.json"
    save_cost_model(ProxyCost(), path)
    with pytest.raises(ValueError, match=r"proxy\.json: a ProxyCost cannot be planned with"):
        load_planner_model(str(path))
    assert load_planner_model("llava-ov-0.5b-a100").encoder_layers == 27
