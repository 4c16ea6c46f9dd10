"""The library (data_prep, pretrain, finetune) and its drivers (tools) live apart: nothing in the library imports
the drivers. Checked by parsing every import statement, at any depth."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

LIBRARY = ("data_prep", "pretrain", "finetune")


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, relative imports resolved against its package (``root``: the
    directory packages are imported from)."""
    package = path.relative_to(root).parent.parts
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, [base, node.module or ""]))
            found += [(node.lineno, module)] + [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def test_nothing_in_the_library_imports_the_tools() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{line}: imports {module}"
                 for package in LIBRARY for path in sorted((ROOT / package).rglob("*.py"))
                 for line, module in imported_modules(path) if module == "tools" or module.startswith("tools.")]
    assert offenders == []


def test_the_check_sees_imports_at_any_depth(tmp_path: Path) -> None:
    probe = tmp_path / "pretrain" / "probe.py"
    probe.parent.mkdir()
    probe.write_text("def f():\n    from tools import demo\n    import tools.bench_all\n    from .model import x\n")
    assert {m for _, m in imported_modules(probe, tmp_path)} >= {"tools", "tools.demo", "tools.bench_all",
                                                                 "pretrain.model.x"}
