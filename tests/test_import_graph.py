"""The house has floors: no import circle among vlcontrast's modules, and none among its rooms.

Every import of every module under ``vlcontrast/`` is read with ``ast`` (imports inside functions
count: hiding an import in a function does not move a concept to the right floor). A room is a
top-level module or a subpackage (``config.py``, ``data/``, ``train/`` ...). An arrow that runs back
up shows as a circle between rooms: ``train`` may import ``data``, but then nothing in ``data`` may
import ``train``. The floors themselves are drawn in docs/architecture.md ("Floors").
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vlcontrast"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The vlcontrast modules ``path`` imports (``from x import y`` counts ``x.y`` when that is a
    module, else ``x``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "vlcontrast/__init__.py"
    is_package = (PACKAGE.joinpath(*parts[1:2])).is_dir()
    return parts[1] + ("/" if is_package else ".py")


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return out


def test_no_import_circle_between_modules():
    edges = graph()
    # A package's __init__ re-exporting its own modules is not a circle of concepts.
    edges = {m: {t for t in ts if not (m.startswith(t + ".") and t in edges)} for m, ts in edges.items()}
    assert circles(edges) == []


def test_no_import_circle_between_rooms():
    rooms: dict[str, set[str]] = {}
    for module, targets in graph().items():
        if room(module) == "vlcontrast/__init__.py":
            continue
        rooms.setdefault(room(module), set()).update(
            room(t) for t in targets if room(t) not in (room(module), "vlcontrast/__init__.py"))
    assert circles(rooms) == [], rooms


def test_the_ground_floor_imports_nothing_of_ours_above_it():
    edges = graph()
    assert edges["vlcontrast.errors"] == set()
    assert edges["vlcontrast.checkpoints"] <= {"vlcontrast.errors"}
    assert edges["vlcontrast.data.naming"] == set()


def test_the_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert room("vlcontrast.data.naming") == "data/" and room("vlcontrast.config") == "config.py"
