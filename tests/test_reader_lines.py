"""Per-line robustness of the readers: each broken line is one bad record, named, and skip skips it alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflop_ds.data import DataError, read_dataset
from dflop_ds.data.validate import validate_dataset
from dflop_ds.shapes import TINY_POLICY


def good(i: int, **extra) -> dict:
    record = {
        "id": f"s{i}",
        "image": "a.jpg",
        "width": 64,
        "height": 48,
        "conversations": [
            {"from": "human", "value": "<image>\nWhat is it?"},
            {"from": "gpt", "value": "A small test picture."},
        ],
    }
    record.update(extra)
    return record


def write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def line(record: dict) -> bytes:
    return json.dumps(record).encode()


BROKEN = {
    "huge integer": b'{"id": "bad", "width": ' + b"9" * 5000 + b', "conversations": []}',
    "deep nesting": b'{"id": "bad", "conversations": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "non-UTF-8 byte": b'{"id": "bad", "conversations": [{"from": "human", "value": "caf\xe9"}]}',
}
REASONS = {"huge integer": "out of range", "deep nesting": "nested too deeply", "non-UTF-8 byte": "not UTF-8"}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_broken_line_is_one_bad_record_named_by_file_line_and_id(tmp_path, kind):
    path = write(tmp_path / "d.jsonl", [line(good(0)), BROKEN[kind], line(good(2))])
    with pytest.raises(DataError) as info:
        read_dataset(path, TINY_POLICY)
    text = str(info.value)
    assert "d.jsonl" in text and "line 2" in text and "'bad'" in text and REASONS[kind] in text, text
    shapes = read_dataset(path, TINY_POLICY, on_bad_sample="skip")
    assert [s.sample_id for s in shapes] == ["s0", "s2"] and shapes.report.skipped_records == [2]


def test_roles_are_case_insensitive_and_unknown_roles_are_named(tmp_path):
    shouting = good(
        0, conversations=[{"from": "Human", "value": "<image>\nWhat?"}, {"from": "GPT", "value": "A picture of a dog."}]
    )
    user = good(
        1,
        conversations=[
            {"from": "system", "value": "Be brief."},
            {"from": "user", "value": "<image>Hi"},
            {"from": "Assistant", "value": "A picture of a dog."},
        ],
    )
    unknown = good(2, conversations=[{"from": "human", "value": "<image>?"}, {"from": "bot", "value": "A dog."}])
    path = write(tmp_path / "d.jsonl", [line(shouting), line(user), line(unknown)])
    shapes = read_dataset(path, TINY_POLICY, on_bad_sample="skip")
    assert [s.sample_id for s in shapes] == ["s0", "s1"]
    assert shapes[0].label_tokens > 0 and shapes[0].label_tokens == shapes[1].label_tokens
    problem = str(shapes.report.problems[0])
    assert "conversations[1].from" in problem and "unknown role 'bot'" in problem


def test_placeholders_without_images_are_flagged(tmp_path):
    no_image = {
        "id": "t",
        "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "Nothing."}],
    }
    two_for_one = good(
        1, conversations=[{"from": "human", "value": "<image><image>\nCompare."}, {"from": "gpt", "value": "Same."}]
    )
    path = write(tmp_path / "d.jsonl", [line(no_image), line(two_for_one), line(good(2))])
    shapes = read_dataset(path, TINY_POLICY, on_bad_sample="skip")
    assert [s.sample_id for s in shapes] == ["s2"]
    messages = [str(p) for p in shapes.report.problems]
    assert "1 <image> placeholder(s) but the record has 0 image(s)" in messages[0]
    assert "2 <image> placeholder(s) but the record has 1 image(s)" in messages[1]


def test_validate_flags_records_the_trainer_would_reject(tmp_path):
    empty = {"id": "e", "conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": ""}]}
    path = write(tmp_path / "d.jsonl", [line(good(0)), line(empty), BROKEN["huge integer"]])
    problems = validate_dataset(path, TINY_POLICY)
    assert [(p.record, p.sample_id) for p in problems] == [(2, "e"), (3, "bad")]
    assert "only empty assistant turns: 0 label tokens, nothing to learn" in str(problems[0])
