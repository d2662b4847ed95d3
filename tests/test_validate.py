"""validate_dataset reports every problem of a file; the `validate` CLI prints them and exits 1."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from dflop_ds.commands.data import register
from dflop_ds.data import Problem, format_problems, validate_dataset
from dflop_ds.shapes import TINY_POLICY

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"


def conv(text: str = "question", answer: str = "answer") -> list[dict]:
    return [{"from": "human", "value": text}, {"from": "gpt", "value": answer}]


def where(problems: list[Problem]) -> set[tuple[int | None, str | None]]:
    return {(p.record, p.field) for p in problems}


def test_manifest_with_one_of_each_bad_record(tmp_path: Path, write_jsonl) -> None:
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"id": "good", "images": [[640, 480]], "text_tokens": 10},  # 1
            "{not json",  # 2 malformed
            {"images": [], "text_tokens": 3},  # 3 missing id
            {"id": "t", "text_tokens": "many"},  # 4 wrong type
            {"id": "n", "images": [[-3, 5]], "text_tokens": 3},  # 5 negative size
            {"id": "huge", "images": [[200000, 5]], "text_tokens": 3},  # 6 absurd size
            {"id": "frames", "video_frames": 10**8, "text_tokens": 3},  # 7 absurd frames
            {"id": "good", "text_tokens": 1},  # 8 duplicate id
            {"id": "long", "text_tokens": 5000},  # 9 over the token cap
            {"id": "two", "images": [[0, 1]], "video_frames": -1, "text_tokens": 1, "label_tokens": 9},  # 10
            [1, 2],  # 11 not an object
            {"id": "fine", "text_tokens": 7},  # 12
        ],
    )
    problems = validate_dataset(path, TINY_POLICY, max_llm_tokens=1000)
    assert where(problems) == {
        (2, None),
        (3, "id"),
        (4, "text_tokens"),
        (5, "images[0].width"),
        (6, "images[0].width"),
        (7, "video_frames"),
        (8, "id"),
        (9, "llm_tokens"),
        (10, "images[0].width"),
        (10, "video_frames"),
        (10, "label_tokens"),
        (11, None),
    }
    assert all(p.path == str(path) for p in problems)
    assert [p.record for p in problems] == sorted(p.record for p in problems)  # file order
    by_record = {p.record: p for p in problems}
    assert by_record[8].sample_id == "good" and "duplicate" in by_record[8].message
    assert by_record[9].sample_id == "long" and "over the cap of 1000" in by_record[9].message
    assert "implausibly large" in by_record[6].message


def test_llava_with_one_of_each_bad_record(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(
        json.dumps(
            [
                {"id": "ok", "image": "known.jpg", "conversations": conv()},  # 0
                {"id": "nosize", "image": "unknown.jpg", "conversations": conv()},  # 1 missing size
                {"id": "noconv", "image": "known.jpg"},  # 2 missing field
                {"id": "badturn", "conversations": [{"from": "human", "value": None}]},  # 3 wrong type
                {"id": "vid", "video": "unknown.mp4", "conversations": conv()},  # 4 no frames
                {"id": "ok", "conversations": conv()},  # 5 duplicate
                {"id": "tiles", "image": ["known.jpg"] * 3, "conversations": conv()},  # 6 over tile cap
            ]
        )
    )
    problems = validate_dataset(path, TINY_POLICY, image_sizes={"known.jpg": [1000, 1000]}, max_encoder_tiles=10)
    assert where(problems) == {
        (1, "image"),
        (2, "conversations"),
        (3, "conversations[0].value"),
        (4, "video"),
        (5, "id"),
        (6, "encoder_tiles"),
    }
    assert all(p.record_kind == "index" for p in problems)
    # With a fallback, the missing size is no longer a problem.
    assert (1, "image") not in where(
        validate_dataset(path, TINY_POLICY, image_sizes={"known.jpg": [1000, 1000]}, fallback_size=(640, 480))
    )


def test_unreadable_broken_and_unknown_files(tmp_path: Path, write_jsonl) -> None:
    (missing,) = validate_dataset(tmp_path / "nope.jsonl")
    assert missing.record is None and "cannot read" in missing.message
    broken = tmp_path / "broken.json"
    broken.write_text('[\n{"id": "a", "text_tokens": 1},\n{"id"\n')
    (problem,) = validate_dataset(broken)
    assert "invalid JSON array" in problem.message and problem.record == 4
    unknown = write_jsonl(tmp_path / "unknown.jsonl", [{"id": "a", "tokens": 3}])
    (problem,) = validate_dataset(unknown)
    assert "cannot tell the format" in problem.message


def test_bad_side_table_is_reported_with_the_rest(tmp_path: Path, write_jsonl) -> None:
    table = tmp_path / "sizes.json"
    table.write_text(json.dumps({"a.jpg": [0, 10]}))
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "x", "image": "a.jpg", "conversations": conv()}])
    problems = validate_dataset(data, image_sizes=table)
    assert {(p.path, p.field) for p in problems} == {(str(table), "a.jpg.width"), (str(data), "image")}


def test_clean_bundled_mixture_has_no_problems() -> None:
    assert validate_dataset(EXAMPLES / "mixture.jsonl", TINY_POLICY, max_llm_tokens=4096) == []


def test_format_problems() -> None:
    assert format_problems([]) == "no problems found"
    problems = [
        Problem("f.jsonl", 3, "line", "abc", "images[1]", "must be positive, got -3"),
        Problem("f.jsonl", 3, "line", "abc", "text_tokens", "is missing"),
        Problem("f.jsonl", 9, "line", None, None, "malformed JSON"),
    ]
    text = format_problems(problems).splitlines()
    assert text[0] == "f.jsonl line 3 (id 'abc'), field 'images[1]': must be positive, got -3"
    assert text[2] == "f.jsonl line 9: malformed JSON"
    assert text[-1] == "3 problem(s) in 2 record(s)"


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dflop-ds")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_validate_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture, write_jsonl) -> None:
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": "a", "text_tokens": -1}, "{x", {"id": "b", "text_tokens": 900}])
    assert run_cli(["validate", str(bad), "--policy", "tiny", "--max-llm-tokens", "100"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and out[-1] == "3 problem(s) in 3 record(s)"
    assert "line 1 (id 'a'), field 'text_tokens'" in out[0] and "line 2" in out[1] and "line 3 (id 'b')" in out[2]
    assert run_cli(["validate", str(EXAMPLES / "mixture.jsonl"), "--policy", "tiny"]) == 0
    assert "3000 samples, no problems" in capsys.readouterr().out


def test_cli_side_table_and_fallback(tmp_path: Path, capsys: pytest.CaptureFixture, write_jsonl) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "x", "image": "a.jpg", "conversations": conv()}])
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"a.jpg": [100, 100]}))
    assert run_cli(["validate", str(data)]) == 1  # the default image folder is the data file's
    assert f"image file not found: {tmp_path / 'a.jpg'}" in capsys.readouterr().out
    assert run_cli(["validate", str(data), "--image-sizes", str(table)]) == 0
    assert run_cli(["validate", str(data), "--fallback-size", "640x480"]) == 0
    with pytest.raises(SystemExit):
        run_cli(["validate", str(data), "--fallback-size", "640by480"])
