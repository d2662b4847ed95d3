"""One source of truth per launch: digests, serialization and the rank-0 broadcast of the inputs
(dflop_ds.train.launch_inputs). The 2-process cases run on a gloo group of their own, without
DeepSpeed's launcher; test_launch_inputs_deepspeed.py trains a real 2-rank launch."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dflop_ds.config import DFLOPConfig, set_settings
from dflop_ds.cost import FittedCostModel, save_cost_model
from dflop_ds.data import read_dataset
from dflop_ds.launch import free_port
from dflop_ds.schedule.state import dataset_fingerprint
from dflop_ds.shapes import TINY_POLICY, SampleShape
from dflop_ds.train.launch_inputs import (
    COST_MODEL,
    DATA_FILE,
    MEDIA,
    MISSING,
    NAMED_MEDIA,
    PLAN,
    SHAPE_TABLE,
    InputDigest,
    SetupStepError,
    agree_on_inputs,
    all_ranks_or_none,
    cost_model_digest,
    disagreements,
    file_digest,
    input_digests,
    json_digest,
    media_differences,
    media_listing,
    mismatch_report,
    step_failures,
)

RECORDS = [
    {"id": "a", "text_tokens": 30, "label_tokens": 4},
    {"id": "b", "images": [[336, 336]], "text_tokens": 20, "label_tokens": 3},
    {"id": "c", "images": [[672, 672]], "text_tokens": 40, "label_tokens": 5},
]


def config(**settings) -> DFLOPConfig:
    return DFLOPConfig.from_dict(set_settings({"data": {"policy": "tiny"}}, **settings))


def test_the_shapes_are_checked_before_the_cost_model_is_read(tmp_path, write_jsonl):
    """``check_shapes`` runs on the shapes read, before the cost model (a file that is not there
    here, or the tiny model's profile): its error is what stops the launch."""
    data = write_jsonl(tmp_path / "data.jsonl", [{"id": "a", "text_tokens": 5}, {"id": "b", "text_tokens": 7}])
    cfg = config(data=str(data), cost_model=str(tmp_path / "absent_costmodel.json"))
    seen = []

    def refuse(shapes) -> None:
        seen.append(len(shapes))
        raise ValueError("too few samples")

    with pytest.raises(ValueError, match="too few samples"):
        agree_on_inputs(cfg, lambda: read_dataset(data, TINY_POLICY), log=lambda _: None, check_shapes=refuse)
    assert seen == [2]
    with pytest.raises(Exception, match="absent_costmodel"):  # without the check, the missing file stops it
        agree_on_inputs(cfg, lambda: read_dataset(data, TINY_POLICY), log=lambda _: None)


def test_json_digest_depends_on_content_not_key_order():
    assert json_digest({"a": 1, "b": [1.5, 2]}) == json_digest({"b": [1.5, 2], "a": 1})
    assert json_digest({"a": 1}) != json_digest({"a": 2})
    assert json_digest(None) == json_digest(None) != json_digest({})


def test_file_digest_is_of_the_bytes(tmp_path):
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    one.write_text('{"id": "a"}\n')
    two.write_text('{"id": "a"}\n')
    assert file_digest(one) == file_digest(two)
    two.write_text('{"id": "a"} \n')
    assert file_digest(one) != file_digest(two)


def test_a_broadcast_cost_model_predicts_and_digests_as_rank_zeros_and_its_file(tmp_path):
    """The cost model travels as an object (pickled, as ``broadcast_object_list`` carries it): the
    copy predicts as the original, and its digest is that of the original's file content, so a
    rank reading the file agrees; the proxy (None) digests as JSON null."""
    from test_costmodel import synthetic_profile

    model = FittedCostModel().fit(synthetic_profile(), TINY_POLICY)
    sent = pickle.loads(pickle.dumps(model))
    shapes = [SampleShape("s", encoder_tiles=3, llm_tokens=90, text_tokens=20)]
    assert sent.predict_samples(shapes).tolist() == model.predict_samples(shapes).tolist()
    path = tmp_path / "cm.json"
    save_cost_model(model, path)
    assert cost_model_digest(sent) == cost_model_digest(model) == json_digest(json.loads(path.read_text()))
    other = FittedCostModel().fit(synthetic_profile(noise=0.2, seed=3), TINY_POLICY)
    assert cost_model_digest(other) != cost_model_digest(model)
    assert cost_model_digest(None) == json_digest(None)


def test_input_digests_cover_what_a_rank_holds(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS))
    shapes = read_dataset(data, TINY_POLICY)
    held = input_digests(
        shapes=shapes,
        cost_model=None,
        cost_source="proxy",
        plan_state=None,
        plan_source="no plan",
        data_path=str(data),
        shapes_source="read here",
    )
    by_name = {d.name: d for d in held}
    assert set(by_name) == {SHAPE_TABLE, COST_MODEL, PLAN, DATA_FILE}
    assert by_name[SHAPE_TABLE].digest == dataset_fingerprint(shapes)
    assert by_name[DATA_FILE] == InputDigest(DATA_FILE, file_digest(data), str(data))
    taken = input_digests(  # a rank that holds neither shapes nor a cost model of its own
        shapes=None,
        cost_model=None,
        cost_source=None,
        plan_state=None,
        plan_source=None,
        data_path=str(tmp_path / "absent.jsonl"),
        shapes_source="",
    )
    assert taken == [InputDigest(DATA_FILE, "missing", str(tmp_path / "absent.jsonl"))]


def test_disagreements_name_the_input_both_digests_and_both_sources():
    reference = [InputDigest(COST_MODEL, "aaaa", "/cache/a.json"), InputDigest(PLAN, "pppp", "plan.json")]
    mine = [InputDigest(COST_MODEL, "bbbb", "/node2/cm.json"), InputDigest(PLAN, "pppp", "plan.json")]
    (problem,) = disagreements(reference, mine, rank=3)
    for part in ("rank 3", COST_MODEL, "aaaa", "bbbb", "/cache/a.json", "/node2/cm.json"):
        assert part in problem
    assert disagreements(reference, reference, rank=1) == []
    assert disagreements(reference, [InputDigest(DATA_FILE, "dddd", "x")], rank=1) == []  # rank 0 holds none
    assert mismatch_report([[], []]) is None
    report = mismatch_report([[], [problem]])
    assert report is not None and problem in report and "docs/multinode.md" in report


def test_one_process_resolves_its_own_inputs(tmp_path):
    """Without a process group the process is rank 0: it reads the shapes once, loads the named
    cost model, and digests every input it holds (shape table, cost model, plan, data file,
    media), as the log line says."""
    from test_costmodel import synthetic_profile
    from tiny_plans import two_stage_plan

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(dict(r, image=f"{r['id']}.png")) for r in RECORDS))
    (tmp_path / "a.png").write_bytes(b"12345")
    model = FittedCostModel().fit(synthetic_profile(), TINY_POLICY)
    save_cost_model(model, tmp_path / "cm.json")
    plan = two_stage_plan()
    cfg = config(data=str(data), cost_model=str(tmp_path / "cm.json"))
    messages: list[str] = []
    reads: list[int] = []

    def read():
        reads.append(1)
        return read_dataset(data, TINY_POLICY)

    inputs = agree_on_inputs(cfg, read, plan, log=messages.append)
    assert reads == [1] and [s.sample_id for s in inputs.shapes] == ["a", "b", "c"]
    assert inputs.shapes.report.n_skipped == 0  # the read report travels with the shapes
    probe = [SampleShape("s", encoder_tiles=3, llm_tokens=90, text_tokens=20)]
    assert inputs.cost_model is not None
    assert inputs.cost_model.predict_samples(probe).tolist() == model.predict_samples(probe).tolist()
    media = {"image:a.png": 5, "image:b.png": MISSING, "image:c.png": MISSING}
    expected = {
        SHAPE_TABLE: dataset_fingerprint(inputs.shapes),
        COST_MODEL: json_digest(json.loads((tmp_path / "cm.json").read_text())),
        PLAN: json_digest(plan.to_dict()),
        DATA_FILE: file_digest(data),
        MEDIA: json_digest(media),
    }
    assert {d.name: d.digest for d in inputs.digests} == expected
    assert all(f"{name} {digest}" in messages[-1] for name, digest in expected.items()), messages
    sent = pickle.loads(pickle.dumps(inputs.shapes))  # as broadcast_object_list carries it to the other ranks
    assert dataset_fingerprint(sent) == dataset_fingerprint(inputs.shapes) and sent.report.n_read == 3


def _gloo_rank(rank: int, port: int, results, body: Callable[..., dict], args: tuple) -> None:
    """One rank of a 2-process gloo group: ``results[rank]`` is what ``body(rank, *args)`` returns
    (``{"crash": traceback}`` when it raises)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    outcome = {}
    try:
        outcome = body(rank, *args)
    except Exception:
        outcome = {"crash": traceback.format_exc()}
    finally:
        results[rank] = outcome
        dist.destroy_process_group()


def on_two_ranks(body: Callable[..., dict], *args) -> dict[int, dict]:
    """``body(rank, *args)`` on each rank of a 2-process gloo group of its own (``body`` a
    module-level function, as spawned processes import it): what each rank returned, checked
    not to have crashed."""
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        port = free_port()
        processes = [context.Process(target=_gloo_rank, args=(r, port, results, body, args)) for r in (0, 1)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=120)
        outcomes = dict(results)
    assert set(outcomes) == {0, 1}, outcomes
    for rank in (0, 1):
        assert "crash" not in outcomes[rank], outcomes[rank]
    return outcomes


def outcome_of(call: Callable[[], Any]) -> str:
    """What ``call()`` returned, or the error it raised as ``Type: message``."""
    try:
        return f"returned {call()!r}"
    except Exception as error:
        return f"{type(error).__name__}: {error}"


def _agree_with_own_data_file(rank: int, folder: str) -> dict:
    """Each rank reads its own data file; then rank 0 fails to read."""
    data = Path(folder) / f"data{rank}.jsonl"
    cfg = config(data=str(data), cost_model="proxy")
    outcome = {}
    for case, read in (
        ("own data file", lambda: read_dataset(data, TINY_POLICY)),
        ("rank 0 fails", lambda: read_dataset(Path(folder) / "absent.jsonl", TINY_POLICY)),
    ):
        outcome[case] = outcome_of(
            lambda read=read: agree_on_inputs(cfg, read, log=lambda _: None).shapes.report.n_read
        )
    return outcome


def test_two_ranks_with_different_data_files_both_stop_naming_it(tmp_path):
    """Rank 1's data file differs from rank 0's: both ranks stop before training, with the input,
    both digests and both paths; when rank 0 cannot read the data, rank 1 stops with its reason
    instead of waiting in a collective."""
    (tmp_path / "data0.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS))
    (tmp_path / "data1.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS[:2]))
    outcomes = on_two_ranks(_agree_with_own_data_file, str(tmp_path))
    for rank in (0, 1):
        message = outcomes[rank]["own data file"]
        assert message.startswith("InputMismatchError"), message
        for part in (
            "rank 1",
            DATA_FILE,
            file_digest(tmp_path / "data0.jsonl"),
            file_digest(tmp_path / "data1.jsonl"),
            str(tmp_path / "data0.jsonl"),
            str(tmp_path / "data1.jsonl"),
        ):
            assert part in message, (part, message)
    assert outcomes[0]["rank 0 fails"].startswith("DataError")  # its own error, as before
    assert "rank 0 stopped the launch" in outcomes[1]["rank 0 fails"]
    assert "absent.jsonl" in outcomes[1]["rank 0 fails"]


def _agree_on_a_cost_model(rank: int, folder: str) -> dict:
    """Every rank agrees on the inputs of a config naming a cost-model file: what each trains with."""
    data = Path(folder) / "data.jsonl"
    cfg = config(data=str(data), cost_model=str(Path(folder) / "cm.json"))
    inputs = agree_on_inputs(cfg, lambda: read_dataset(data, TINY_POLICY), log=lambda _: None)
    probe = [SampleShape("s", encoder_tiles=3, llm_tokens=90, text_tokens=20)]
    model = inputs.cost_model
    return {
        "kind": type(model).__name__,
        "costs": model.predict_samples(probe).tolist(),
        "digest": cost_model_digest(model),
    }


def test_every_rank_trains_with_rank_zeros_cost_model_object(tmp_path):
    """On a real 2-process group rank 1 receives rank 0's cost model as an object: the same kind,
    the same predictions and the same digest as the file both ranks can read."""
    from test_costmodel import synthetic_profile

    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS))
    model = FittedCostModel().fit(synthetic_profile(), TINY_POLICY)
    save_cost_model(model, tmp_path / "cm.json")
    outcomes = on_two_ranks(_agree_on_a_cost_model, str(tmp_path))
    assert outcomes[0] == outcomes[1]
    assert outcomes[1]["kind"] == "FittedCostModel"
    assert outcomes[1]["digest"] == json_digest(json.loads((tmp_path / "cm.json").read_text()))


@pytest.mark.parametrize("named", [True, False])
def test_a_named_cost_model_is_checked_a_cached_one_is_taken(tmp_path, named):
    """Pure part of the rank check: with a cost model named in the config, a rank compares its own
    file's digest; without one, it takes rank 0's and compares no cost model of its own, while
    what it does read itself (here a plan unlike rank 0's) is still checked."""
    from test_costmodel import synthetic_profile

    from dflop_ds.train.launch_inputs import check_against_rank_zero

    model = FittedCostModel().fit(synthetic_profile(), TINY_POLICY)
    other = FittedCostModel().fit(synthetic_profile(noise=0.2, seed=3), TINY_POLICY)
    path = tmp_path / "cm.json"
    save_cost_model(other, path)
    digest = cost_model_digest(model)
    shared = {
        "shapes": [],
        "cost_model": model,
        "cost_source": "the profile cache /rank0/costmodel.json",
        "reference": [
            InputDigest(COST_MODEL, digest, "the profile cache /rank0/costmodel.json"),
            InputDigest(PLAN, json_digest(None), "no plan"),
        ],
    }
    cfg = config(cost_model=str(path)) if named else config()
    problems = check_against_rank_zero(cfg, shared, {"stages": 2}, "/node2/plan.json", rank=1)
    *cost_problems, plan_problem = problems
    assert "its plan differs" in plan_problem and "/node2/plan.json" in plan_problem
    if named:
        (problem,) = cost_problems
        assert str(path) in problem and "/rank0/costmodel.json" in problem and digest in problem
    else:
        assert cost_problems == []


def test_a_rank_with_another_plan_is_told_which_and_why(tmp_path):
    from tiny_plans import one_stage_plan, two_stage_plan

    from dflop_ds.train.launch_inputs import check_against_rank_zero

    theirs, mine = two_stage_plan().to_dict(), one_stage_plan().to_dict()
    shared = {"shapes": [], "cost_model": None, "cost_source": "proxy"}
    shared["reference"] = [InputDigest(PLAN, json_digest(theirs), "/shared/plan.json")]
    (problem,) = check_against_rank_zero(config(cost_model="proxy"), shared, mine, "/node2/plan.json", rank=5)
    for part in ("rank 5", "plan", json_digest(theirs), json_digest(mine), "/shared/plan.json", "/node2/plan.json"):
        assert part in problem
    assert check_against_rank_zero(config(cost_model="proxy"), shared, theirs, "/node2/plan.json", rank=5) == []


def _one_rank_fails_to_set_up(rank: int, folder: str) -> dict:
    """A set-up step that fails on rank 1 only (its model file is missing), one that succeeds
    everywhere, then the launch's inputs where rank 1's image folder lacks one image."""
    model = Path(folder) / f"model{rank}.txt"
    outcome = {"fails on rank 1": outcome_of(lambda: all_ranks_or_none("loading the model", model.read_text))}
    try:
        all_ranks_or_none("loading the model", model.read_text)
    except SetupStepError as error:
        outcome["cause"] = type(error.__cause__).__name__
    outcome["succeeds"] = outcome_of(lambda: all_ranks_or_none("counting", lambda: rank + 1))
    data = Path(folder) / "media.jsonl"
    cfg = config(data=str(data), cost_model="proxy", image_folder=str(Path(folder) / f"images{rank}"))
    read = lambda: read_dataset(data, TINY_POLICY)  # noqa: E731
    outcome["media"] = outcome_of(lambda: agree_on_inputs(cfg, read, log=lambda _: None).shapes.report.n_read)
    return outcome


def test_a_set_up_failure_on_one_rank_stops_every_rank_naming_it(tmp_path):
    """Rank 1 cannot load its model: both ranks raise the same error naming rank 1 and its reason
    (not rank 0 waiting in the next collective); a rank whose image folder lacks a file the
    records name is told which file before the first step."""
    (tmp_path / "model0.txt").write_text("weights")
    media_records = [dict(record, image=f"{record['id']}.png") for record in RECORDS]
    (tmp_path / "media.jsonl").write_text("\n".join(json.dumps(r) for r in media_records))
    for rank, names in ((0, "abc"), (1, "ab")):  # rank 1 lacks c.png
        (tmp_path / f"images{rank}").mkdir()
        for name in names:
            (tmp_path / f"images{rank}" / f"{name}.png").write_bytes(b"x" * 10)
    outcomes = on_two_ranks(_one_rank_fails_to_set_up, str(tmp_path))
    failed = outcomes[0]["fails on rank 1"]
    assert failed == outcomes[1]["fails on rank 1"]
    assert failed.startswith("SetupStepError: loading the model failed on rank(s) 1 of 2"), failed
    assert "rank 1: FileNotFoundError" in failed and str(tmp_path / "model1.txt") in failed
    assert "rank 0:" not in failed
    assert outcomes[1]["cause"] == "FileNotFoundError" and outcomes[0]["cause"] == "NoneType"
    assert outcomes[0]["succeeds"] == "returned 1" and outcomes[1]["succeeds"] == "returned 2"
    for rank in (0, 1):
        message = outcomes[rank]["media"]
        assert message.startswith("InputMismatchError"), message
        assert "rank 1: image c.png is missing there, 10 bytes on rank 0" in message, message
        assert "a.png" not in message and MEDIA in message


def test_step_failures_names_each_failing_rank():
    assert step_failures("loading the model", [None, None]) is None
    report = step_failures("loading the model", ["OSError: no a", None, "OSError: no c"])
    assert report == "loading the model failed on rank(s) 0, 2 of 3:\n  rank 0: OSError: no a\n  rank 2: OSError: no c"


def test_media_listing_and_differences_name_missing_and_changed_files(tmp_path):
    records = [{"id": "a", "image": ["x.png", "y.png"]}, {"id": "b", "video": "v.mp4"}, {"id": "c"}]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records))
    (tmp_path / "x.png").write_bytes(b"1234")
    (tmp_path / "v.mp4").write_bytes(b"12")
    mine = media_listing(str(data))  # default folder: the data file's
    assert mine == {"image:x.png": 4, "image:y.png": MISSING, "video:v.mp4": 2}
    reference = {"image:x.png": 5, "image:y.png": 3, "video:v.mp4": 2}
    assert media_differences(reference, mine, rank=2) == [
        "rank 2: image x.png is 4 bytes there, 5 bytes on rank 0",
        "rank 2: image y.png is missing there, 3 bytes on rank 0",
    ]
    many = {f"image:{i}.png": i for i in range(NAMED_MEDIA + 3)}
    problems = media_differences(many, {}, rank=1)
    assert len(problems) == NAMED_MEDIA + 1 and problems[-1] == "rank 1: ... and 3 more media file(s) differ"
