"""The project's layers point one way, and every library file holds one job. Checked by parsing every import
statement at any depth (inside functions too):

    tools/                    drivers (demo, ablation, benchmarks); nothing in the library imports them
    finetune/                 fine-tuning: imports the shared runtime, never pre-training's application
    pretrain/ application     config, trainer, train, preflight, plot, export: the pre-training run
    pretrain/ shared runtime  model, masks, kernels, data, engine, checkpoints, ...: used by both applications
    data_prep/                offline shard builds and the shard format
    common/                   generic helpers: files, locks, signals, the typed config loader, the repository root
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from conftest import ROOT

LIBRARY = ("common", "data_prep", "pretrain", "finetune")
PACKAGES = (*LIBRARY, "tools")
PRETRAIN_APPLICATION = {"pretrain.config", "pretrain.trainer", "pretrain.train", "pretrain.preflight", "pretrain.plot",
                        "pretrain.export"}
"""Pre-training's own run: besides these, a module whose docstring starts with "Pre-training application:"."""
MAX_LINES = 600


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


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    return {module_name(path, root): path for package in packages for path in sorted((root / package).rglob("*.py"))}


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: first line}; ``from a.b import c`` counts as importing ``a.b.c``
    when that is a module, else ``a.b``."""
    modules = project_modules(root, packages)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for line, target in imported_modules(path, root):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(), filename=str(path))) or ""


def pretrain_application(modules: dict[str, Path]) -> set[str]:
    return PRETRAIN_APPLICATION | {name for name, path in modules.items() if name.startswith("pretrain.")
                                   and _docstring(path).startswith("Pre-training application:")}


def layer_violations(root: Path = ROOT) -> Iterator[str]:
    """Every import that points the wrong way, as ``file:line: A imports B (why not)``."""
    modules = project_modules(root)
    application = pretrain_application(modules)

    def package(name: str) -> str:
        return name.split(".")[0]

    for name, edges in import_graph(root).items():
        for target, line in edges.items():
            where = f"{modules[name].relative_to(root)}:{line}: {name} imports {target}"
            if package(name) == "common" and package(target) != "common":
                yield f"{where} (common/ imports nothing else of the project)"
            elif package(name) == "data_prep" and package(target) not in ("common", "data_prep"):
                yield f"{where} (data_prep/ imports only common/)"
            elif package(name) in LIBRARY and package(target) == "tools":
                yield f"{where} (the library never imports the tools)"
            elif package(name) == "pretrain" and package(target) == "finetune":
                yield f"{where} (pretrain/ never imports finetune/)"
            elif package(name) == "finetune" and target in application:
                yield f"{where} (fine-tuning uses the shared runtime, not pre-training's application)"
            elif name.startswith("pretrain.") and name not in application and target in application:
                yield f"{where} (the shared runtime imports no application module)"


def test_layers_point_one_way() -> None:
    assert list(layer_violations()) == []


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_every_library_file_holds_one_named_job_in_at_most_600_lines() -> None:
    problems = []
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                problems.append(f"{path.relative_to(ROOT)}: {lines} lines (at most {MAX_LINES})")
            first = _docstring(path).split("\n")[0].strip()
            if not first:
                problems.append(f"{path.relative_to(ROOT)}: no module docstring naming its job")
    assert problems == []


def test_the_check_sees_imports_at_any_depth(tmp_path: Path) -> None:
    probe = tmp_path / "pretrain" / "probe.py"
    probe.parent.mkdir()
    probe.write_text("def f():\n    from tools import demo\n    import tools.bench_all\n    from .model import x\n")
    assert {m for _, m in imported_modules(probe, tmp_path)} >= {"tools", "tools.demo", "tools.bench_all",
                                                                 "pretrain.model.x"}


def test_the_checks_find_a_cycle_and_a_wrong_way_import(tmp_path: Path) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text('"""A package."""\n')
    (tmp_path / "pretrain" / "a.py").write_text('"""A."""\ndef f():\n    from pretrain import b\n')
    (tmp_path / "pretrain" / "b.py").write_text('"""B."""\nfrom pretrain.a import f\n')
    (tmp_path / "data_prep" / "c.py").write_text('"""C."""\nimport pretrain.a\n')
    (tmp_path / "finetune" / "d.py").write_text('"""D."""\nfrom pretrain.trainer import x\n')
    (tmp_path / "pretrain" / "trainer.py").write_text('"""Trainer."""\nx = 1\n')
    assert cycles(import_graph(tmp_path)) == [["pretrain.a", "pretrain.b"]]
    found = "\n".join(layer_violations(tmp_path))
    assert "data_prep.c imports pretrain.a (data_prep/ imports only common/)" in found
    assert "finetune.d imports pretrain.trainer (fine-tuning uses the shared runtime" in found
