"""tests/direct_ranks.py, which most multi-rank tests start their ranks with: each rank gets what the
``deepspeed`` launcher gives it; a failing rank stops the others; a timeout kills every rank."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import psutil
import pytest
from direct_ranks import run_ranks
from ds_runs import REPO, run_on_ranks

#: a rank that writes what it was started with to ``<last argument>.<rank>.json`` and prints a line
#: on stdout and one on stderr
REPORT = """
import json, os, sys
with open(f"{sys.argv[-1]}.{os.environ['RANK']}.json", "w") as out:
    json.dump({"env": dict(os.environ), "argv": sys.orig_argv, "path": sys.path[0], "cwd": os.getcwd()}, out)
os.write(1, f"out of rank {os.environ['RANK']}\\n".encode())  # one write each: lines of the
os.write(2, f"err of rank {os.environ['RANK']}\\n".encode())  # two ranks may not interleave
"""


@pytest.mark.slow
def test_each_rank_gets_the_environment_and_arguments_the_deepspeed_launcher_gives_it(tmp_path: Path) -> None:
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    results = {}
    for launcher in ("deepspeed", "direct"):
        results[launcher] = run_on_ranks(script, ["--flag", tmp_path / launcher], launcher=launcher, timeout=300)
    for rank in (0, 1):
        given = {name: json.loads((tmp_path / f"{name}.{rank}.json").read_text()) for name in results}
        for name, report in given.items():  # each launch has its own port and report file
            assert report["env"].pop("MASTER_PORT").isdigit() and report["argv"].pop() == str(tmp_path / name)
        assert given["direct"] == given["deepspeed"], rank
        assert given["direct"]["env"]["RANK"] == str(rank) and f"--local_rank={rank}" in given["direct"]["argv"]
        assert given["direct"]["cwd"] == str(REPO)
        # the ranks share one stdout and one stderr, as under the launcher
        for name, result in results.items():
            assert f"out of rank {rank}\n" in result.stdout and f"err of rank {rank}\n" in result.stderr, name


#: rank 0 writes its pid to ``<last argument>`` and waits; rank 1 exits with code 3 once rank 0 is up,
#: or waits too when there is a second argument
FAILING = """
import os, sys, time
if os.environ["RANK"] == "0":
    with open(sys.argv[-1] + ".tmp", "w") as pid:
        pid.write(str(os.getpid()))
    os.rename(sys.argv[-1] + ".tmp", sys.argv[-1])
else:
    while not os.path.exists(sys.argv[-1]):
        time.sleep(0.01)
    if len(sys.argv) == 3:
        sys.exit(3)
time.sleep(600)
"""


def test_a_failing_rank_stops_the_others_and_a_timeout_stops_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    result = run_ranks(script, [tmp_path / "failed.pid"], timeout=120)
    waiting = int((tmp_path / "failed.pid").read_text())
    assert result.returncode == 3 and "rank 1 exited with code 3: the other ranks were stopped" in result.stderr
    assert not psutil.pid_exists(waiting)
    with pytest.raises(subprocess.TimeoutExpired):
        run_ranks(script, ["--wait", tmp_path / "timeout.pid"], timeout=5)
    assert not psutil.pid_exists(int((tmp_path / "timeout.pid").read_text()))
