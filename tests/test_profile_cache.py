"""Profile cache: one profile per model, machine and software; reused while they match; StageCost."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflop_ds.cost import PackedCost, StageCost, load_cost_model, save_cost_model
from dflop_ds.models.tiny_profile import cached_tiny_cost_model
from dflop_ds.plan.stages import stage_shares
from dflop_ds.profile.cache import cached_cost_model, key_digest, profile_key
from dflop_ds.profile.model import TIMING_PROTOCOL
from dflop_ds.shapes import SampleShape

#: a small, fast profile of the tiny model
FAST = dict(tiles=(1, 4), seq_lens=(16, 64), batch_sizes=(1, 2), warmup=0, repeats=1, progress=False)
SMALL = {"vision_layers": 2, "llm_layers": 2}


def test_profiles_once_then_reuses(tmp_path):
    messages: list[str] = []
    first, path = cached_tiny_cost_model(SMALL, tmp_path, log=messages.append, **FAST)
    mtime = path.stat().st_mtime_ns
    second, again = cached_tiny_cost_model(SMALL, tmp_path, log=messages.append, **FAST)
    assert again == path and path.stat().st_mtime_ns == mtime  # not profiled again
    assert any("profiling" in m for m in messages) and any("reusing" in m for m in messages)
    shapes = [SampleShape("a", encoder_tiles=4, llm_tokens=60, text_tokens=20)]
    np.testing.assert_allclose(first.predict_samples(shapes), second.predict_samples(shapes))
    key = json.loads(path.with_suffix(".key.json").read_text())
    assert set(key) == {"model", "machine", "software", "options"}
    assert key["software"]["torch"] and key["machine"]["cores"]


def test_other_model_or_options_profile_again(tmp_path):
    _, path = cached_tiny_cost_model(SMALL, tmp_path, log=lambda _: None, **FAST)
    _, deeper = cached_tiny_cost_model({**SMALL, "llm_layers": 3}, tmp_path, log=lambda _: None, **FAST)
    _, longer = cached_tiny_cost_model(SMALL, tmp_path, log=lambda _: None, **{**FAST, "seq_lens": (16, 128)})
    assert len({path, deeper, longer}) == 3
    assert load_cost_model(deeper).llm_layers == load_cost_model(path).llm_layers + 1  # one more decoder block


def test_a_stale_key_file_is_not_trusted(tmp_path):
    from dflop_ds.models import TinyMLLMConfig
    from dflop_ds.models.tiny_profile import tiny_target

    model = {"name": "tiny", "vision_layers": 2, "llm_layers": 2}
    config = TinyMLLMConfig(vision_layers=2, llm_layers=2)
    _, path = cached_cost_model(model, lambda: tiny_target(config), tmp_path, log=lambda _: None, **FAST)
    key = json.loads(path.with_suffix(".key.json").read_text())
    key["software"]["torch"] = "0.0"  # a file written under other software, same name
    path.with_suffix(".key.json").write_text(json.dumps(key))
    calls = []
    cached_cost_model(model, lambda: calls.append(1) or tiny_target(config), tmp_path, log=lambda _: None, **FAST)
    assert calls == [1]


def test_a_cached_file_this_version_cannot_read_is_profiled_again(tmp_path):
    from dflop_ds.models import TinyMLLMConfig
    from dflop_ds.models.tiny_profile import tiny_target

    model = {"name": "tiny", "vision_layers": 2, "llm_layers": 2}
    config = TinyMLLMConfig(vision_layers=2, llm_layers=2)
    _, path = cached_cost_model(model, lambda: tiny_target(config), tmp_path, log=lambda _: None, **FAST)
    stale = json.loads(path.read_text())
    stale["format_version"] = 2  # e.g. written by an older dflop-ds under the same key
    path.write_text(json.dumps(stale))
    calls, messages = [], []
    again, _ = cached_cost_model(
        model, lambda: calls.append(1) or tiny_target(config), tmp_path, log=messages.append, **FAST
    )
    assert calls == [1] and any("profiling again" in m for m in messages)
    assert load_cost_model(path).llm_layers == again.llm_layers


def test_key_digest_is_stable_and_sensitive():
    key = profile_key({"name": "m"}, {"repeats": 3})
    assert key_digest(key) == key_digest(json.loads(json.dumps(key)))
    assert key_digest(key) != key_digest(profile_key({"name": "m"}, {"repeats": 5}))
    assert key["software"]["timing_protocol"] == str(TIMING_PROTOCOL)  # a new protocol profiles again
    # a default passed explicitly keys the same file; another protocol or no calibration a new one
    assert key_digest(profile_key({"name": "m"}, {"repeats": 3, "protocol": "chain", "calibrate": True})) == key_digest(
        key
    )
    for changed in ({"protocol": "layer"}, {"calibrate": False}):
        assert key_digest(profile_key({"name": "m"}, {"repeats": 3, **changed})) != key_digest(key)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    model, _ = cached_tiny_cost_model(SMALL, tmp_path_factory.mktemp("cache"), log=lambda _: None, **FAST)
    return model


def test_stage_cost_splits_segments_by_stage_shares(tiny_model):
    shapes = [
        SampleShape("a", encoder_tiles=4, llm_tokens=60, text_tokens=20),
        SampleShape("b", encoder_tiles=0, llm_tokens=30, text_tokens=30),
    ]
    n_flat = tiny_model.encoder_layers + 1 + tiny_model.llm_layers
    bounds = [0, tiny_model.encoder_layers + 2, n_flat]  # encoder, projector and one LLM layer on stage 0
    shares = stage_shares(bounds, tiny_model)
    staged = StageCost(tiny_model, shares)
    per_stage = staged.predict_samples(shapes)
    assert per_stage.shape == (2, 2)
    # the stages together cost what the model predicts for the whole sample
    np.testing.assert_allclose(per_stage.sum(axis=1), tiny_model.predict_samples(shapes).sum(axis=1))
    assert per_stage[1, 0] > 0  # stage 0 holds an LLM layer: a text-only sample costs it something
    np.testing.assert_allclose(staged.predict_microbatch(shapes), shares @ tiny_model.predict_microbatch(shapes))
    assert not staged.additive and StageCost(PackedCost(tiny_model), shares).additive


def test_stage_cost_refuses_flat_shares(tiny_model):
    with pytest.raises(ValueError, match="num_stages"):
        StageCost(tiny_model, np.ones(2))


def test_the_training_loop_resolves_its_cost_model(tmp_path, tiny_model, capsys):
    from dflop_ds.config import DFLOPConfig, set_settings
    from dflop_ds.train.launch_inputs import resolve_cost_model

    def config(**settings):
        return DFLOPConfig.from_dict(set_settings({}, **settings))

    path = tmp_path / "costmodel.json"
    save_cost_model(tiny_model, path)
    loaded, source = resolve_cost_model(config(cost_model=str(path)))
    assert loaded.llm_layers == tiny_model.llm_layers and source == str(path)
    assert resolve_cost_model(config(cost_model="proxy"))[0] is None
    hf = config(model_name_or_path=str(tmp_path))
    assert resolve_cost_model(hf)[0] is None
    assert "unitless proxy" in capsys.readouterr().out


def test_a_stored_cost_model_is_what_the_cache_reuses(tmp_path, tiny_model):
    """store_cost_model writes under the key cached_cost_model looks up: nothing is profiled."""
    from dflop_ds.models.tiny_profile import tiny_model_identity
    from dflop_ds.profile.cache import store_cost_model

    key = profile_key(tiny_model_identity(SMALL), FAST)
    stored = store_cost_model(tiny_model, tmp_path, key)
    messages: list[str] = []
    reused, path = cached_tiny_cost_model(SMALL, tmp_path, log=messages.append, **FAST)
    assert path == stored and not any("profiling" in m for m in messages)
    shapes = [SampleShape("a", encoder_tiles=4, llm_tokens=60, text_tokens=20)]
    np.testing.assert_allclose(reused.predict_samples(shapes), tiny_model.predict_samples(shapes))
