"""The docs name the code as it is: every C++ name they quote (`class::member`,
`namespace::name`) exists in cpp/, and every file they link to exists. A rename or a removal
that leaves a doc behind fails here, not in a reader's head.

A source distribution leaves some folders out (pyproject.toml's sdist.exclude: the recorded
benchmark results, the CI scripts), and the tests run from one too: a link into such a folder
is checked wherever the folder is there, and skipped where it is not."""

from __future__ import annotations

import fnmatch
import functools
import re
from pathlib import Path, PurePosixPath

import pytest

from tests.conftest import needs_repository

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md"])
CPP = ROOT / "cpp"
# Namespaces of other projects that the docs quote (PyTorch's, CUDA's, the standard library).
FOREIGN = ("std", "c10", "torch", "at", "cuda", "pybind11", "py", "rmm", "cupy", "numba")
QUOTED = re.compile(r"`((?:[A-Za-z_][A-Za-z_0-9]*::)+[A-Za-z_~][A-Za-z_0-9]*)(?:\(\))?`")
LINK = re.compile(r"\]\(((?:\.\./|\./)?[^)#:\s]+)(?:#[^)]*)?\)")
# A link to this repository's own files by URL (where a source distribution has no copy): it is
# checked as a path from the root.
REPOSITORY = "https://github.com/emmpool/emmpool/blob/main/"
REPO_LINK = re.compile(rf"\]\({re.escape(REPOSITORY)}([^)#\s]+)(?:#[^)]*)?\)")

pytestmark = pytest.mark.skipif(not CPP.is_dir() or not (ROOT / "docs").is_dir(),
                                reason=needs_repository("docs/ and cpp/"))


COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


@functools.cache
def sources() -> dict[Path, str]:
    """cpp/'s sources without their comments: a comment that still names an old function is
    no definition of it."""
    return {p: COMMENT.sub(" ", p.read_text()) for p in CPP.rglob("*")
            if p.suffix in {".hpp", ".cpp", ".h", ".inc"}}


@functools.cache
def declaring(scope: str) -> tuple[str, ...]:
    """The sources of cpp/ that define class, struct, namespace or enum class `scope`, with a
    body (not a forward declaration)."""
    declares = re.compile(rf"\b(?:class|struct|namespace|enum class)\s+{re.escape(scope)}\b[^;{{]*{{")
    return tuple(t for t in sources().values() if declares.search(t))


@functools.cache
def defined(qualified: str) -> bool:
    """Whether `A::B` names something of cpp/: written so somewhere in code (an out-of-line
    definition, a use), or B is a word of the code of a file that defines class, struct or
    namespace A."""
    *scope, name = qualified.split("::")
    written = re.compile(rf"\b{re.escape(qualified)}\b")
    word = re.compile(rf"\b{re.escape(name)}\b")
    return any(written.search(t) for t in sources().values()) or any(
        word.search(t) for t in declaring(scope[-1]))


def quoted_names():
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for name in QUOTED.findall(line):
                if name.split("::")[0] not in FOREIGN:
                    yield doc, number, name


def test_every_cpp_name_the_docs_quote_exists():
    missing = [f"{doc.relative_to(ROOT)}:{number}: `{name}`"
               for doc, number, name in quoted_names() if not defined(name)]
    assert not missing, "names the code no longer has:\n" + "\n".join(missing)


@functools.cache
def sdist_excluded() -> tuple[str, ...]:
    """The patterns a source distribution leaves out (pyproject.toml's
    [tool.scikit-build] sdist.exclude, gitignore-style)."""
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the one line, as pyproject.toml writes it
        found = re.search(r"^sdist\.exclude\s*=\s*\[([^\]]*)\]", text, re.M)
        return tuple(re.findall(r'"([^"]+)"', found.group(1))) if found else ()
    build = tomllib.loads(text).get("tool", {}).get("scikit-build", {})
    return tuple(build.get("sdist", {}).get("exclude", ()))


def excluded_folder(target: Path) -> Path | None:
    """The folder or file of the repository, left out of a source distribution, that holds
    `target`; None if a source distribution has it. Patterns as gitignore reads them: one with
    a slash at its start or inside is anchored at the root, one without matches a name at any
    depth."""
    try:
        parts = PurePosixPath(target.resolve().relative_to(ROOT).as_posix()).parts
    except ValueError:
        return None  # outside the repository
    for pattern in sdist_excluded():
        pattern = pattern.rstrip("/")
        anchored = "/" in pattern
        wanted = PurePosixPath(pattern.lstrip("/")).parts
        starts = [0] if anchored else range(len(parts))
        for start in starts:
            here = parts[start:start + len(wanted)]
            if len(here) == len(wanted) and all(map(fnmatch.fnmatchcase, here, wanted)):
                return ROOT.joinpath(*parts[:start + len(wanted)])
    return None


def link_is_broken(doc: Path, target: str) -> bool:
    """Whether a relative link of `doc` leads nowhere. Into what a source distribution leaves
    out, only where the repository has it (a folder that is absent is an sdist's)."""
    path = doc.parent / target
    if path.exists():
        return False
    left_out = excluded_folder(path)
    return left_out is None or left_out.exists()


# In a comment: `A::b` with or without backquotes.
NAMED = re.compile(r"\b((?:[A-Za-z_][A-Za-z_0-9]*::)+[A-Za-z_~][A-Za-z_0-9]*)")


def test_every_name_of_ours_a_code_comment_gives_exists():
    missing = []
    for path in sorted(sources()):
        text = path.read_text()
        for comment in COMMENT.finditer(text):
            for name in NAMED.findall(comment.group()):
                name = name.removeprefix("emmpool::")
                if "::" in name and declaring(name.split("::")[-2]) and not defined(name):
                    line = text.count("\n", 0, comment.start()) + 1
                    missing.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not missing, "comments name what the code no longer has:\n" + "\n".join(missing)


def test_every_file_the_docs_link_to_exists():
    missing = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if target.startswith(("http", "mailto")):
                    continue
                if link_is_broken(doc, target):
                    missing.append(f"{doc.relative_to(ROOT)}:{number}: {target}")
            for target in REPO_LINK.findall(line):
                if link_is_broken(ROOT / "README.md", target):
                    missing.append(f"{doc.relative_to(ROOT)}:{number}: {REPOSITORY}{target}")
    assert not missing, "links to nothing:\n" + "\n".join(missing)


def test_the_check_finds_what_it_is_for():
    assert defined("device_pool::allocate") and defined("detail::pool_ledger")
    assert defined("stream_lanes::join_open")
    assert not defined("device_pool::deallocate_tagged")
    assert not defined("device_pool::share_pages")  # pool_sharing's; its header names the pool
    assert not defined("detail::no_such_thing")

    design = ROOT / "docs" / "design.md"
    assert link_is_broken(design, "no_such_page.md")
    assert not link_is_broken(design, "limits.md")
    # what a source distribution leaves out, as pyproject.toml says
    results = ROOT / "benchmarks" / "results"
    assert excluded_folder(results / "H200" / "bench_core.md") == results
    assert excluded_folder(ROOT / ".ci" / "gpu.py") == ROOT / ".ci"
    assert excluded_folder(ROOT / "benchmarks" / "replay.py") is None
    # anchored at the root: not a benchmarks/results/ anywhere deeper
    assert excluded_folder(ROOT / "python" / "benchmarks" / "results" / "x.md") is None
    # a missing file there is a broken link wherever the repository has the folder
    assert link_is_broken(design, "../benchmarks/results/no_such_run.md") == results.is_dir()
    # the repository's URL of a file is checked as that file
    assert REPO_LINK.findall(f"[x]({REPOSITORY}benchmarks/results/H200/a.md#b)") == [
        "benchmarks/results/H200/a.md"]
