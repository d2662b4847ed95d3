"""Data profiler: seeded sampling, statistics, histograms, JSON round trip, version refusal, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dflop_ds.commands.main import main as cli_main
from dflop_ds.profile import DataProfile, profile_data
from dflop_ds.profile.data import histogram, sample_indices, summarize
from dflop_ds.shapes import TINY_POLICY, ShapePolicy


def write_manifest(path: Path, n: int = 60) -> Path:
    """A manifest mixing text, single images, multi-image and video samples."""
    rows = []
    for i in range(n):
        record: dict = {"id": f"s{i}", "text_tokens": 10 + 7 * i, "label_tokens": 5}
        kind = i % 4
        if kind == 1:
            record["images"] = [[336 * (1 + i % 3), 336]]
        elif kind == 2:
            record["images"] = [[640, 480], [480, 640]]
        elif kind == 3:
            record["video_frames"] = 3 + i
        rows.append(json.dumps(record))
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture()
def manifest(tmp_path: Path) -> Path:
    return write_manifest(tmp_path / "data.jsonl")


def test_profile_samples_are_seeded_and_statistics_match_them(manifest: Path) -> None:
    first = profile_data(manifest, TINY_POLICY, samples=25, seed=3)
    again = profile_data(manifest, TINY_POLICY, samples=25, seed=3)
    other = profile_data(manifest, TINY_POLICY, samples=25, seed=4)
    assert first.shapes == again.shapes and first.shapes != other.shapes
    assert len(first.shapes) == 25 and first.n_total == 60
    assert len({s.sample_id for s in first.shapes}) == 25  # drawn without replacement
    tokens = [s.llm_tokens for s in first.shapes]
    assert first.stats["llm_tokens"]["mean"] == pytest.approx(np.mean(tokens))
    assert first.stats["llm_tokens"]["max"] == max(tokens)
    assert first.stats["encoder_tiles"]["p50"] == pytest.approx(np.median([s.encoder_tiles for s in first.shapes]))
    assert sum(first.histograms["llm_tokens"]["counts"]) == 25
    assert sum(first.modalities.values()) == 25
    assert first.policy["tokens_per_tile"] == TINY_POLICY.tokens_per_tile


def test_policy_changes_the_recorded_shapes(manifest: Path) -> None:
    tiny = profile_data(manifest, TINY_POLICY, samples=None)
    big = profile_data(manifest, ShapePolicy(), samples=None)
    assert len(tiny.shapes) == 60
    assert big.stats["llm_tokens"]["mean"] > tiny.stats["llm_tokens"]["mean"]


def test_sample_shapes_draws_from_the_profile(manifest: Path) -> None:
    profile = profile_data(manifest, TINY_POLICY, samples=20, seed=0)
    drawn = profile.sample_shapes(200, seed=1)
    assert len(drawn) == 200 and set(drawn) <= set(profile.shapes)
    assert drawn == profile.sample_shapes(200, seed=1)
    assert drawn != profile.sample_shapes(200, seed=2)
    with pytest.raises(ValueError, match="n must be >= 0"):
        profile.sample_shapes(-1)


def test_json_round_trip(manifest: Path, tmp_path: Path) -> None:
    profile = profile_data(manifest, TINY_POLICY, samples=30, seed=5)
    path = tmp_path / "dp.json"
    profile.save(path)
    loaded = DataProfile.load(path)
    assert loaded == profile
    assert loaded.sample_shapes(10, seed=9) == profile.sample_shapes(10, seed=9)


def test_refuses_another_version_and_names_the_file(manifest: Path, tmp_path: Path) -> None:
    data = profile_data(manifest, TINY_POLICY, samples=5).to_dict()
    data["format_version"] = 7
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"old\.json.*format_version 7"):
        DataProfile.load(path)
    data["format_version"] = 1
    data["shapes"][2]["bogus"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"shape #2"):
        DataProfile.load(path)


def test_helpers() -> None:
    assert sample_indices(10, None, 0) == list(range(10))
    assert sample_indices(10, 50, 0) == list(range(10))
    picked = sample_indices(100, 10, 1)
    assert len(set(picked)) == 10 and picked == sorted(picked)
    hist = histogram([1, 1, 1], bins=4)
    assert sum(hist["counts"]) == 3 and len(hist["edges"]) == 5
    assert summarize([])["max"] == 0.0


def test_data_cli_writes_a_profile(manifest: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "dp.json"
    assert cli_main(["profile", "data", str(manifest), "--samples", "12", "-o", str(out)]) == 0
    assert "data profile of" in capsys.readouterr().out
    assert len(DataProfile.load(out).shapes) == 12
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "text_tokens": -3}\n')
    assert cli_main(["profile", "data", str(bad), "-o", str(tmp_path / "never.json")]) == 1
    assert not (tmp_path / "never.json").exists()


def test_bundled_mixture_profiles(tmp_path: Path) -> None:
    mixture = Path(__file__).resolve().parents[1] / "examples" / "data" / "mixture.jsonl"
    if not mixture.exists():
        pytest.skip("examples/data/mixture.jsonl not present")
    profile = profile_data(mixture, TINY_POLICY, samples=300, seed=0)
    assert set(profile.modalities) == {"text", "image", "multi_image", "video"}
    assert profile.stats["encoder_tiles"]["min"] == 0
