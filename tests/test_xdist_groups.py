"""tests/xdist_groups.py: the files that share a session-scoped launch land in one worker's group,
and the groups with slow tests are scheduled first."""

from __future__ import annotations

from pathlib import Path

from xdist_groups import file_groups, session_fixtures

CONFTEST = """
import pytest

@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    return 1

@pytest.fixture(scope="session")
def other_run(tmp_path_factory):
    return 2

@pytest.fixture
def per_test():
    return 3
"""


def write(folder: Path, name: str, text: str) -> None:
    (folder / name).write_text(text)


def test_files_sharing_a_session_fixture_form_one_group_weighted_by_slow_tests(tmp_path: Path) -> None:
    write(tmp_path, "conftest.py", CONFTEST)
    slow = "import pytest\n\n@pytest.mark.slow\n"
    write(tmp_path, "test_a.py", slow + "def test_a(shared_run):\n    pass\n")
    write(tmp_path, "test_b.py", slow + "def test_b(other_run):\n    pass\n" + slow + "def test_b2():\n    pass\n")
    write(tmp_path, "test_c.py", "import pytest\n\n@pytest.fixture\ndef mine(shared_run, other_run):\n    return 0\n")
    write(tmp_path, "test_d.py", "def test_d(per_test):\n    pass\n")
    assert session_fixtures(tmp_path / "conftest.py") == {"shared_run", "other_run"}
    groups = file_groups.__wrapped__(tmp_path)
    # c's fixture takes both session runs: a, b and c are one group, with a's and b's 3 slow tests
    assert groups == {
        "test_a.py": ("test_a.py", 3),
        "test_b.py": ("test_a.py", 3),
        "test_c.py": ("test_a.py", 3),
        "test_d.py": ("test_d.py", 0),
    }


def test_this_suite_keeps_the_users_of_each_session_launch_together() -> None:
    groups = file_groups()
    assert groups["test_resume.py"][0] == groups["test_train_e2e.py"][0]  # dflop_pp2_run
    assert groups["test_colocated_zero.py"][0] == groups["test_plan_colocated.py"][0]  # colocated_plan_run
    assert groups["test_colocated_zero.py"][0] == groups["test_colocated_pipe.py"][0]  # colocated_reports
    assert groups["test_sampler.py"] == ("test_sampler.py", 0)
