"""Docs, docstrings and stored reports point only at the repository: no absolute path of the
machine they were written on (a temporary folder, a home, a checkout)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: absolute paths of a machine: temporary folders, homes, a workspace, root's home
MACHINE_PATH = re.compile(r"(?<![\w.$<])/(?:tmp|home|work|root|Users)/[\w.-]+")
#: where such a path would mislead a reader: docs, the package's docstrings, examples, stored reports
SCANNED = ("README.md", "docs/*.md", "dflop_ds/**/*.py", "examples/**/*.py", "benchmarks/results/*")
#: paths a doc names on purpose, as an example to type (not a place on some machine)
INTENDED = {"/tmp/dflop_gpu_site"}


def test_no_file_names_an_absolute_path_of_the_machine_it_was_written_on():
    found = []
    for pattern in SCANNED:
        for path in sorted(REPO.glob(pattern)):
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                found += [
                    f"{path.relative_to(REPO)}:{number}: {hit}"
                    for hit in MACHINE_PATH.findall(line)
                    if hit not in INTENDED
                ]
    assert not found, "\n".join(found[:20])
