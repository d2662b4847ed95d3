"""Fuzzing the dataset readers: random manifest and LLaVA files, valid and broken.

Invariant: reading either returns shapes whose derived fields are consistent, or raises a
DataError that names the file and the record (and the field, for a field problem); never any
other exception. Under ``on_bad_sample="skip"`` every record is either read or skipped and
reported, the records read are exactly those a strict read accepts, and ``validate_dataset``
(``dflop-ds validate``) names exactly the skipped records.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflop_ds.data import DEFAULT_FALLBACK_SIZE, DataError, read_dataset, validate_dataset
from dflop_ds.shapes import TINY_POLICY, SampleShape

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-10, 10),
    st.integers(-(2**63), 2**63),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
junk = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
counts = st.integers(0, 3000)
sides = st.integers(1, 5000)
sizes = st.lists(st.tuples(sides, sides).map(list), max_size=3)
ids = st.text(min_size=1, max_size=6)


def maybe(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Usually a valid value, sometimes anything."""
    return st.one_of(valid, valid, valid, junk)


@st.composite
def manifest_records(draw) -> dict:
    record = {"id": draw(maybe(ids))}
    if draw(st.booleans()):
        record["images"] = draw(maybe(sizes))
    if draw(st.booleans()):
        record["video_frames"] = draw(maybe(counts))
    text_key = draw(st.sampled_from(["text_tokens", "text", "both", "none"]))
    if text_key in ("text_tokens", "both"):
        record["text_tokens"] = draw(maybe(counts))
    if text_key in ("text", "both"):
        record["text"] = draw(maybe(st.text(max_size=40)))
    if draw(st.booleans()):
        record["label_tokens"] = draw(maybe(counts))
    if draw(st.booleans()):
        record["source"] = draw(maybe(st.text(max_size=5)))
    return record


turns = st.fixed_dictionaries(
    {
        "from": st.sampled_from(["human", "gpt", "assistant", "system"]),
        "value": st.text(max_size=30).map(lambda t: "<image>\n" + t),
    }
)


@st.composite
def llava_records(draw) -> dict:
    record = {
        "id": draw(maybe(ids | st.integers(0, 10**6))),
        "conversations": draw(maybe(st.lists(maybe(turns), min_size=1, max_size=4))),
    }
    n_images = draw(st.integers(0, 3))
    if n_images == 1:
        record["image"] = draw(maybe(st.just("a.jpg")))
        if draw(st.booleans()):
            record["width"], record["height"] = draw(maybe(sides)), draw(maybe(sides))
    elif n_images > 1:
        record["image"] = draw(maybe(st.just([f"{i}.jpg" for i in range(n_images)])))
        if draw(st.booleans()):
            record["image_sizes"] = draw(
                maybe(st.lists(st.tuples(sides, sides).map(list), min_size=n_images, max_size=n_images))
            )
    if draw(st.booleans()):
        record["video"] = draw(maybe(st.just("v.mp4")))
        record["video_frames"] = draw(maybe(counts))
    return record


def lines(records: st.SearchStrategy) -> st.SearchStrategy:
    """JSONL lines: mostly records of one kind, sometimes other JSON or not JSON at all."""
    line = st.one_of(
        records.map(json.dumps),
        records.map(json.dumps),
        records.map(json.dumps),
        junk.map(json.dumps),
        st.sampled_from(["{", "not json", "[1,", '{"id": }']),
    )
    return st.lists(line, min_size=1, max_size=8)


def check_shape(shape: SampleShape) -> None:
    assert isinstance(shape, SampleShape)
    assert shape.encoder_tiles >= len(shape.image_sizes)
    assert shape.llm_tokens == shape.visual_tokens + shape.text_tokens
    assert 0 <= shape.label_tokens <= shape.text_tokens
    assert shape.visual_tokens >= 0 and shape.video_frames >= 0


def check_error(error: DataError, path: Path, n_lines: int) -> None:
    assert error.path == str(path) and str(path) in str(error)
    if error.record is not None:
        assert f"{error.record_kind} {error.record}" in str(error)
        if error.record_kind == "index":  # a file starting with "[" is read as one JSON array
            assert 0 <= error.record
        elif "invalid JSON array" in error.reason:  # where the parser gave up, up to end of file
            assert 1 <= error.record <= n_lines + 1
        else:
            assert 1 <= error.record <= n_lines
    else:  # only whole-file problems carry no record
        assert "no JSON object records" in error.reason
    if error.field is not None:
        assert repr(error.field) in str(error)


def read_both_ways(text_lines: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.jsonl"
        path.write_text("\n".join(text_lines) + "\n")
        strict_error = None
        try:
            strict = read_dataset(path, TINY_POLICY, fallback_size=DEFAULT_FALLBACK_SIZE, fallback_frames=16)
        except DataError as error:
            check_error(error, path, len(text_lines))
            strict_error = error
        problems = validate_dataset(path, TINY_POLICY, fallback_size=DEFAULT_FALLBACK_SIZE, fallback_frames=16)
        try:
            lenient = read_dataset(
                path, TINY_POLICY, fallback_size=DEFAULT_FALLBACK_SIZE, fallback_frames=16, on_bad_sample="skip"
            )
        except DataError as error:  # nothing to read at all: the same file-level refusal
            check_error(error, path, len(text_lines))
            assert strict_error is not None and error.record == strict_error.record
            assert [p.message for p in problems] == [error.reason]
            return
    report = lenient.report
    for shape in lenient:
        check_shape(shape)
    assert report.n_read + report.n_skipped == report.n_records
    if not text_lines[0].lstrip().startswith("["):  # JSONL: one record per non-blank line
        assert report.n_records == sum(1 for t in text_lines if t.strip())
    assert len({s.sample_id for s in lenient}) == len(lenient)
    for problem in report.problems:
        check_error(problem, path, len(text_lines))
        assert problem.record in report.skipped_records
    # `dflop-ds validate` names every bad record, and only those
    assert {p.record for p in problems} == set(report.skipped_records)
    assert len(problems) == len(report.problems)
    if strict_error is None:
        assert report.n_skipped == 0 and list(strict) == list(lenient)
    else:
        assert strict_error.record in report.skipped_records  # the first bad record is skipped too


@SETTINGS
@given(lines(manifest_records()))
def test_random_manifests_read_or_fail_clearly(text_lines):
    read_both_ways(text_lines)


@SETTINGS
@given(lines(llava_records()))
def test_random_llava_files_read_or_fail_clearly(text_lines):
    read_both_ways(text_lines)


valid_manifest = st.fixed_dictionaries(
    {
        "id": ids,
        "images": sizes,
        "video_frames": counts,
        "text_tokens": st.integers(10, 3000),
        "label_tokens": st.integers(0, 10),
    }
)
corruptions = {
    "id": st.sampled_from([7, None, "", ["x"]]),
    "images": st.sampled_from(["a.jpg", [[0, 10]], [[10]], [["w", 5]], {"w": 1}]),
    "video_frames": st.sampled_from([-1, 2.5, "8", None, 10**12]),
    "text_tokens": st.sampled_from([-3, "12", 1.5, None, [1]]),
    "label_tokens": st.sampled_from([-1, "1", 10**4]),
}


@SETTINGS
@given(valid_manifest, st.sampled_from(sorted(corruptions)), st.data())
def test_one_bad_field_is_named(record, key, data):
    record[key] = data.draw(corruptions[key])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "one.jsonl"
        path.write_text(json.dumps({"id": "ok", "text_tokens": 3}) + "\n" + json.dumps(record) + "\n")
        try:
            read_dataset(path, TINY_POLICY)
        except DataError as error:
            check_error(error, path, 2)
            assert error.record == 2 and error.field is not None and error.field.startswith(key)
        else:
            raise AssertionError(f"a record with {key}={record[key]!r} was accepted")
