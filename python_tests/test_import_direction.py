"""Imports point one way (issue 45 item 8): no module imports, at the top or lazily inside a function, a module that
imports it back, within one package of dllm_fast (dllm_fast.rollout, dllm_fast.train, ...), across dllm_fast's
packages (issue 46: planning.parallel took the rollout rule from train.rollout_weights, which asks the planner back)
or among the scripts of benchmarks/. Read from the source (ast), so a lazy import counts as much as a top-level
one."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def module_files(folder: Path, prefix: str) -> dict[str, Path]:
    """Module name -> file for every .py directly in `folder` (a package's __init__ is left out: importing a
    package's own name from its modules is the package's namespace, not a circle)."""
    return {f"{prefix}{path.stem}": path for path in sorted(folder.glob("*.py")) if path.stem != "__init__"}


def imported_names(path: Path, package: str) -> set[str]:
    """Every dotted name an import statement in `path` may load: the module, and module.name for `from` imports
    (a submodule imported by name). Relative imports are resolved against `package`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
    return names


def circles(modules: dict[str, Path], package: str) -> list[list[str]]:
    """The import circles among `modules` (strongly connected groups of two or more, Tarjan's algorithm)."""
    graph = {name: sorted(imported_names(path, package) & set(modules) - {name}) for name, path in modules.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(name):
        index[name] = low[name] = len(index)
        stack.append(name)
        on_stack.add(name)
        for other in graph[name]:
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in on_stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            group = []
            while not group or group[-1] != name:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                found.append(sorted(group))

    for name in graph:
        if name not in index:
            visit(name)
    return found


PACKAGES = sorted(path.parent for path in (ROOT / "dllm_fast").rglob("__init__.py"))


@pytest.mark.parametrize("package", PACKAGES, ids=lambda path: ".".join(path.relative_to(ROOT).parts))
def test_no_import_circle_within_a_dllm_fast_package(package):
    name = ".".join(package.relative_to(ROOT).parts)
    assert circles(module_files(package, name + "."), name) == []


def all_module_files() -> dict[str, Path]:
    """Module name -> file for every module of dllm_fast, in every package (the packages' __init__ left out, as in
    module_files)."""
    modules = {}
    for path in sorted((ROOT / "dllm_fast").rglob("*.py")):
        if path.stem != "__init__":
            modules[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    return modules


def circles_across(modules: dict[str, Path]) -> list[list[str]]:
    """The import circles among modules of several packages (each module's relative imports resolved against its
    own package)."""
    graph_modules = {}
    for name, path in modules.items():
        package = name.rsplit(".", 1)[0]
        graph_modules[name] = (path, package)
    found = []
    for group in _strongly_connected({name: sorted(imported_names(path, package) & set(modules) - {name})
                                      for name, (path, package) in graph_modules.items()}):
        found.append(group)
    return found


def _strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(name):
        index[name] = low[name] = len(index)
        stack.append(name)
        on_stack.add(name)
        for other in graph[name]:
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in on_stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            group = []
            while not group or group[-1] != name:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                found.append(sorted(group))

    for name in graph:
        if name not in index:
            visit(name)
    return found


def test_no_import_circle_across_dllm_fast_packages():
    """The planner imports train's configuration and rules; train asks the planner back only from modules the
    planner never imports (micro_batch, rollout_weights): no circle through both packages, or any others."""
    assert circles_across(all_module_files()) == []


def test_the_planner_takes_the_rollout_rule_from_below():
    """planning.parallel's rollout rule (gathered or sharded, kept or freed) comes from train.rollout_rule, which
    imports no dllm_fast module, and not from train.rollout_weights, which imports the planner."""
    modules = all_module_files()
    parallel = imported_names(modules["dllm_fast.planning.parallel"], "dllm_fast.planning")
    assert "dllm_fast.train.rollout_rule" in parallel and "dllm_fast.train.rollout_weights" not in parallel
    rule = imported_names(modules["dllm_fast.train.rollout_rule"], "dllm_fast.train")
    assert not {name for name in rule if name.startswith("dllm_fast")}


def test_a_circle_across_packages_is_found(tmp_path):
    """The check itself: planning -> train at the top, train -> planning lazily, is a circle."""
    for package in ("planning", "train"):
        (tmp_path / "pkg" / package).mkdir(parents=True)
    (tmp_path / "pkg" / "planning" / "parallel.py").write_text("from pkg.train.rollout_weights import rule\n")
    (tmp_path / "pkg" / "train" / "rollout_weights.py").write_text(
        "def planned():\n    from pkg.planning.parallel import plan\n")
    modules = {"pkg.planning.parallel": tmp_path / "pkg" / "planning" / "parallel.py",
               "pkg.train.rollout_weights": tmp_path / "pkg" / "train" / "rollout_weights.py"}
    assert circles_across(modules) == [["pkg.planning.parallel", "pkg.train.rollout_weights"]]


def test_no_import_circle_among_the_benchmark_scripts():
    # The scripts import each other by bare name (benchmarks/ is on sys.path when one runs).
    assert circles(module_files(ROOT / "benchmarks", ""), "") == []


def test_a_lazy_import_back_is_found(tmp_path):
    """The check itself: a function-level import that closes a circle is reported."""
    (tmp_path / "low.py").write_text("def f():\n    from pkg.high import g\n")
    (tmp_path / "high.py").write_text("from pkg.low import f\n")
    assert circles(module_files(tmp_path, "pkg."), "pkg") == [["pkg.high", "pkg.low"]]
