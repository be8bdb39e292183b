"""The docs name the code as it is: every C++ name they quote (`class::member`,
`namespace::name`) exists in cpp/, and every file they link to exists. A rename or a removal
that leaves a doc behind fails here, not in a reader's head."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from tests.conftest import needs_repository

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md"])
CPP = ROOT / "cpp"
# Namespaces of other projects that the docs quote (PyTorch's, CUDA's, the standard library).
FOREIGN = ("std", "c10", "torch", "at", "cuda", "pybind11", "py", "rmm", "cupy", "numba")
QUOTED = re.compile(r"`((?:[A-Za-z_][A-Za-z_0-9]*::)+[A-Za-z_~][A-Za-z_0-9]*)(?:\(\))?`")
LINK = re.compile(r"\]\(((?:\.\./|\./)?[^)#:\s]+)(?:#[^)]*)?\)")

pytestmark = pytest.mark.skipif(not CPP.is_dir() or not (ROOT / "docs").is_dir(),
                                reason=needs_repository("docs/ and cpp/"))


COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


@functools.cache
def sources() -> dict[Path, str]:
    """cpp/'s sources without their comments: a comment that still names an old function is
    no definition of it."""
    return {p: COMMENT.sub(" ", p.read_text()) for p in CPP.rglob("*")
            if p.suffix in {".hpp", ".cpp", ".h", ".inc"}}


def defined(qualified: str) -> bool:
    """Whether `A::B` names something of cpp/: written so somewhere in code (an out-of-line
    definition, a use), or B is a word of the code of a file that defines class, struct or
    namespace A."""
    *scope, name = qualified.split("::")
    owner = scope[-1]
    written = re.compile(rf"\b{re.escape(qualified)}\b")
    # a definition, with a body (not a forward declaration)
    declares = re.compile(rf"\b(?:class|struct|namespace|enum class)\s+{re.escape(owner)}\b[^;{{]*{{")
    word = re.compile(rf"\b{re.escape(name)}\b")
    texts = sources().values()
    return any(written.search(t) for t in texts) or any(
        declares.search(t) and word.search(t) for t in texts)


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


def test_every_file_the_docs_link_to_exists():
    missing = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if target.startswith(("http", "mailto")):
                    continue
                if not (doc.parent / target).exists():
                    missing.append(f"{doc.relative_to(ROOT)}:{number}: {target}")
    assert not missing, "links to nothing:\n" + "\n".join(missing)


def test_the_check_finds_what_it_is_for():
    assert defined("device_pool::allocate") and defined("detail::pool_ledger")
    assert defined("stream_lanes::join_open")
    assert not defined("device_pool::deallocate_tagged")
    assert not defined("device_pool::share_pages")  # pool_sharing's; its header names the pool
    assert not defined("detail::no_such_thing")
