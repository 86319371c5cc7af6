"""The packages import one way only (docs/architecture.md):

    aospec -> runtime -> drafters -> replay -> training -> specbox -> live -> integrations   (then scripts)

(installed as ``aospec`` and ``aospec.runtime``, ``aospec.drafters``, ...: the engine is the
``aospec`` package less its seven sub-packages). A package may import itself and the packages before it, never one after it, and no two
files import each other, directly or around a circle. Checked twice: by importing each
package with all its modules in a fresh interpreter and looking at ``sys.modules``, and
by reading every import statement of the source (also those inside functions) and the
``"package.module:attr"`` strings that registries resolve later.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The declared order, lowest first.
ORDER = ("aospec", "runtime", "drafters", "replay", "training", "specbox", "live", "integrations")
#: Each package's folder in the repository and its import name.
FOLDERS = {pkg: ROOT / pkg for pkg in ORDER}
IMPORT_NAME = {pkg: pkg if pkg == "aospec" else f"aospec.{pkg}" for pkg in ORDER}

# Temporary allowances, each named with the reason (none now): an upward import as
# (module, package), a circle as a frozenset of modules. The test fails once one is unused.
ALLOWED_UPWARD: set[tuple[str, str]] = set()
ALLOWED_CYCLES: set[frozenset[str]] = set()

_DOTTED = re.compile(r"^(aospec(?:\.[A-Za-z_]\w*)*):[A-Za-z_][\w.]*$")


def _module_name(pkg: str, path: Path) -> str:
    parts = list(path.relative_to(FOLDERS[pkg]).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([IMPORT_NAME[pkg], *parts])


def _modules() -> dict[str, Path]:
    return {_module_name(pkg, p): p for pkg in ORDER for p in sorted(FOLDERS[pkg].rglob("*.py"))}


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module ``name`` refers to: itself, or the nearest package or module above it
    (``from a.b import c`` names module ``a.b.c`` or an attribute of ``a.b``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def _references(module: str, path: Path) -> tuple[set[str], set[str]]:
    """(modules imported anywhere in the file, modules named by dotted-path strings)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    imported: set[str] = set()
    named: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(r for a in node.names if (r := _resolve(a.name)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                target = _resolve(f"{source}.{alias.name}") if alias.name != "*" else None
                if target != f"{source}.{alias.name}":
                    target = _resolve(source)
                if target:
                    imported.add(target)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and (m := _DOTTED.match(node.value))
            and (target := _resolve(m.group(1)))
        ):
            named.add(target)
    imported.discard(module)
    return imported, named


GRAPH = {m: _references(m, p) for m, p in MODULES.items()}


def _package(module: str) -> str:
    """The floor a module belongs to: ``aospec.runtime.overlay`` -> runtime, ``aospec.session`` -> aospec."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ORDER[1:] else "aospec"


def _rank(module: str) -> int:
    return ORDER.index(_package(module))


def _upward(module: str, target: str) -> bool:
    return _rank(target) > _rank(module) and (module, _package(target)) not in ALLOWED_UPWARD


def test_no_module_imports_or_names_a_package_after_its_own() -> None:
    found = []
    for module, (imported, named) in sorted(GRAPH.items()):
        found += [f"{module} imports {t}" for t in sorted(imported) if _upward(module, t)]
        found += [f"{module} names {t!r} by a dotted-path string" for t in sorted(named) if _upward(module, t)]
    assert not found, "imports against the order " + " -> ".join(ORDER) + ":\n" + "\n".join(found)
    used = {
        (m, _package(t))
        for m, (imported, named) in GRAPH.items()
        for t in imported | named
        if _rank(t) > _rank(m)
    }
    for module, package in sorted(ALLOWED_UPWARD):
        assert (module, package) in used, f"allowance {module} -> {package} is no longer needed: remove it"
        warnings.warn(f"temporary allowance: {module} imports {package} (after it in the order)", stacklevel=1)


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_no_import_circle_between_files() -> None:
    cycles = _cycles({m: imported for m, (imported, _) in GRAPH.items()})
    unexpected = [sorted(c) for c in cycles if c not in ALLOWED_CYCLES]
    assert not unexpected, f"import circles between files: {unexpected}"
    for allowed in sorted(ALLOWED_CYCLES, key=sorted):
        assert allowed in cycles, f"allowance for the circle {sorted(allowed)} is no longer needed: remove it"
        warnings.warn(f"temporary allowance: import circle {' <-> '.join(sorted(allowed))}", stacklevel=1)


def test_the_cycle_finder_finds_a_circle_and_the_source_check_sees_imports_inside_functions() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert "aospec.drafters.finetune" in GRAPH["aospec.drafters.lm"][0]  # imported inside LMObservationDrafter.fit
    assert "aospec.drafters.cache" in GRAPH["aospec.drafters"][1]  # the registry's "aospec.drafters.cache:ObservationCache"


_PROBE = """
import importlib, json, pkgutil, sys
pkg, skip = sys.argv[1], set(sys.argv[2:])
top = importlib.import_module(pkg)
for info in pkgutil.walk_packages(top.__path__, pkg + ".", onerror=lambda name: None):
    if info.name.rsplit(".", 1)[-1] != "__main__" and not any(info.name == s or info.name.startswith(s + ".") for s in skip):
        importlib.import_module(info.name)
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize("package", ORDER)
def test_a_package_and_all_its_modules_load_nothing_after_it(package: str) -> None:
    subpackages = [IMPORT_NAME[p] for p in ORDER[1:]] if package == "aospec" else []
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, IMPORT_NAME[package], *subpackages],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout)
    after = ORDER[ORDER.index(package) + 1 :]
    assert IMPORT_NAME[package] in loaded
    assert not [m for m in loaded if m.startswith("aospec.") and _package(m) in after], (
        f"importing {package} loaded packages after it"
    )
