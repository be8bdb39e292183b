"""The repository describes emmpool as it is: no development log in code, docs or README.

Issue numbers, run labels, commit hashes, dated results and "before this" belong in commit
messages and closing notes, where they stay true; in the tree they go stale. Benchmark results
(benchmarks/results/) may say when and where they were measured: that is their data."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ["README.md", "pyproject.toml", "CMakeLists.txt", "docs", "cpp", "python", "tests",
           "benchmarks", ".ci"]
SKIPPED_DIRS = {"results", "__pycache__", "build"}
SUFFIXES = {".md", ".py", ".pyi", ".cpp", ".hpp", ".h", ".inc", ".txt", ".toml", ".cmake", ".sh",
            ""}  # "" : the extensionless scripts of .ci/

LOG = re.compile(
    r"issue #\d+"                                  # issue numbers
    r"|\(#\d+\)|#\d+'s"
    r"|\bsessions? \d+"
    r"|-s1\d-|\bs1\d-(?:numba|core|pytest)"        # run labels
    r"|\b(?:shared|numba|cli-bench|replay)-run\d+"
    r"|\b20\d\d-[01]\d-[0-3]\d\b"                   # dated results
    r"|\b(?:commit|main at) [0-9a-f]{7,40}\b"       # commit hashes
    r"|\bbefore this\s*[,(]|\bdid before\b",
    re.IGNORECASE,
)


def scanned_files():
    for name in SCANNED:
        top = ROOT / name
        if top.is_file():
            yield top
            continue
        if not top.is_dir():
            continue  # not in an sdist, say
        for path in sorted(top.rglob("*")):
            if not path.is_file() or SKIPPED_DIRS & set(path.relative_to(ROOT).parts):
                continue
            if path.suffix in SUFFIXES and path != Path(__file__).resolve():
                yield path


def test_no_development_log_in_code_docs_or_readme():
    found = []
    for path in scanned_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # a binary file
        for number, line in enumerate(text.splitlines(), 1):
            if LOG.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, "development log (say it in a commit message instead):\n" + "\n".join(found)


def test_the_pattern_catches_what_it_is_for():
    for line in ["see issue #18", "fixed in (#14)", "before #14's split", "results/x-s14-core.md",
                 "shared-run5", "on 2026-11-23", "main at 5662da6", "Before this, it",
                 "what emmpool did before"]:
        assert LOG.search(line), line
    for line in ["events complete in issue order", "issued before this free", "0x5000",
                 "python3.12", "2 MiB segments"]:
        assert not LOG.search(line), line
