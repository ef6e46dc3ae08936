"""The layering a newcomer can draw, checked on every import in the tree:

- libraries (``schemas``, ``topics``, ``moderation``, ``producers``, ``stores``) import no service and nothing
  above them; services (``gpu_consumers``, ``sse_edge``, ``stream_processors``) import libraries
  only, never another service; ``infra`` (CLI, dev stack, admin, load generator) sits on top;
- no import cycle between modules at module level (imports inside functions are deliberate
  lazy imports and may point anywhere the layering allows);
- every package folder installs: it is listed in pyproject.toml's ``packages``.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ["schemas", "topics", "moderation", "producers", "stores", "gpu_consumers", "sse_edge", "stream_processors", "infra"]
LAYER = {"schemas": 0, "topics": 1, "stores": 1, "moderation": 1, "producers": 2,
         "gpu_consumers": 3, "sse_edge": 3, "stream_processors": 3, "infra": 4}
# What each library may import, beyond itself (a library sits on the ones listed).
LIBRARY_DEPENDS_ON = {"schemas": set(), "topics": {"schemas"}, "stores": {"schemas", "topics"},
                      "moderation": {"schemas"}, "producers": {"schemas", "topics", "moderation"}}
SERVICES = {"gpu_consumers", "sse_edge", "stream_processors"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "tokenbus." + ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path, name: str, top_level_only: bool) -> set[str]:
    """The ``tokenbus.*`` modules a module imports (``from x import y``: ``x.y`` if that is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    nodes: list[ast.AST] = []
    if top_level_only:
        stack: list[ast.AST] = list(tree.body)
        while stack:
            node = stack.pop()
            if isinstance(node, ast.If) and _is_type_checking(node):
                continue
            nodes.append(node)
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                stack.extend(ast.iter_child_nodes(node))
    else:
        nodes = list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = name if is_package else name.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    package = package.rsplit(".", 1)[0]
                base = f"{package}.{node.module}" if node.module else package
            else:
                base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m.startswith("tokenbus.")}


def folder_of(module: str) -> str:
    return module.split(".")[1]


@pytest.fixture(scope="module")
def tree() -> dict[str, Path]:
    return modules()


def test_the_layout_is_what_this_test_walks(tree):
    assert set(LAYER) == set(FOLDERS) == set(LIBRARY_DEPENDS_ON) | SERVICES | {"infra"}
    assert len(tree) > 80  # the walk found the code, not an empty tree
    assert {folder_of(m) for m in tree} == set(FOLDERS)


def test_no_service_imports_another_and_libraries_import_only_below(tree):
    wrong = []
    for name, path in tree.items():
        own = folder_of(name)
        for target in imports(path, name, top_level_only=False):
            other = folder_of(target)
            if other == own or other not in LAYER:
                continue
            if own in SERVICES and other in SERVICES:
                wrong.append(f"{name} imports {target}: a service imports another service")
            elif own in LIBRARY_DEPENDS_ON and other not in LIBRARY_DEPENDS_ON[own]:
                wrong.append(f"{name} imports {target}: {own} may import only {sorted(LIBRARY_DEPENDS_ON[own])}")
            elif LAYER[other] > LAYER[own]:
                wrong.append(f"{name} imports {target}: an upward import")
    assert not wrong, "\n".join(wrong)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle in ``graph`` as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_at_module_level(tree):
    graph: dict[str, set[str]] = {}
    for name, path in tree.items():
        # a package's own __init__ importing its submodules is how packages re-export
        graph[name] = {m for m in imports(path, name, top_level_only=True)
                       if m in tree and m != name and not m.startswith(name + ".")}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_every_package_folder_is_installed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {module_name(p) for folder in FOLDERS for p in (ROOT / folder).rglob("__init__.py")}
    assert folders == set(config["packages"])
    assert config["package-dir"] == {f"tokenbus.{f}": f for f in FOLDERS}
