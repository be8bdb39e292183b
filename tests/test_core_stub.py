"""emmpool/_core.pyi describes the compiled module as it is: every public name and method of
emmpool._core has its stub, and no stub names what the module lacks."""

from __future__ import annotations

import ast
from pathlib import Path

import emmpool
from emmpool import _core


def stub_tree() -> ast.Module:
    return ast.parse(Path(emmpool.__file__).with_name("_core.pyi").read_text())


def test_every_name_of_the_module_has_a_stub():
    tree = stub_tree()
    stubbed = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    stubbed |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    stubbed |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    names = {n for n in dir(_core) if not n.startswith("__")}
    assert names - stubbed == set(), "bound in _core, missing from _core.pyi"
    assert stubbed - names == set(), "in _core.pyi, not bound in _core"


def test_every_public_method_has_a_stub():
    for cls in (n for n in stub_tree().body if isinstance(n, ast.ClassDef)):
        stubbed = {m.name for m in cls.body if isinstance(m, ast.FunctionDef)}
        bound = {n for n in dir(getattr(_core, cls.name))
                 if not n.startswith("_") and n not in dir(Exception)}
        assert bound - stubbed == set(), f"_core.{cls.name}: bound, missing from _core.pyi"
