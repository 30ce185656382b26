"""The package's layout: what a task author uses at the top, the infrastructure grouped by
the stages of a run, no import cycle, and tasks that stand alone (a copy of one needs no
other)."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers.runs import ROOT

PACKAGE = ROOT / "src" / "ddp_template"
TASKS = PACKAGE / "tasks"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The project's modules a module imports, at load or inside a function (not under
    TYPE_CHECKING): two modules that import each other, even lazily, are one concern."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("ddp_template")}


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports(path) & modules.keys() - {name} for name, path in modules.items()}


def test_no_module_imports_itself_back() -> None:
    edges = graph()
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        for target in sorted(edges[name]):
            if target in path:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in done:
                visit(target, path + [target])
        done.add(name)

    done: set[str] = set()
    for name in sorted(edges):
        if name not in done:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_top_of_the_package_holds_what_a_task_author_uses() -> None:
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert len(top) <= 12, top
    for used_by_tasks in ("module", "data", "optim", "errors", "metrics"):
        assert used_by_tasks in top
    groups = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert groups == ["callbacks", "config", "launch", "resume", "tasks", "tools", "worker"]


def test_each_task_imports_no_other_task() -> None:
    for task in (p for p in TASKS.iterdir() if (p / "__init__.py").exists()):
        for path in task.rglob("*.py"):
            for name in imports(path):
                if name.startswith("ddp_template.tasks."):
                    assert name.split(".")[2] == task.name, f"{path} imports {name}"


def unit(module: str) -> str:
    """A module's package (`ddp_template.worker.results` -> `worker`), or the top module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "ddp_template"


def test_no_import_runs_back_up_between_packages() -> None:
    """Between packages and the top modules the imports form no cycle: a package that uses
    another is never used by it (lazy imports included), so each can be read from below."""
    edges: dict[str, set[str]] = {}
    for name, targets in graph().items():
        for target in targets:
            if unit(name) != unit(target):
                edges.setdefault(unit(name), set()).add(unit(target))

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    back = sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets if reaches(b, a))
    assert not back, "imports that run back up: " + ", ".join(back)
