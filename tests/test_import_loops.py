"""No import loop among hetpipe's own modules: hetpipe/, models/, partitioner/ and comm/.

A loop makes the order in which modules happen to be imported decide whether
a name exists yet, and a reader cannot tell which of the modules is the lower
layer. This test reads the code (no import runs): every import statement of
every module, including the ones inside functions (deferred, they still tie
the modules together), but not those under ``if TYPE_CHECKING:``, which never
run. A statement ``from pkg import name`` depends on ``pkg`` itself (it reads
the package's namespace, so the package's ``__init__`` must have run) and, when
``name`` is a module, on that module too. A failure names each loop as a path,
with the file and line of every import along it.
"""
from __future__ import annotations

import ast
import tomllib
from collections import deque
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]


class Edge(NamedTuple):
    target: str
    where: str  # "path:line" of the import statement


def package_roots(repo: Path) -> dict[str, Path]:
    """Import name -> folder, from pyproject's package-dir (hetpipe.models is models/, ...), for the
    code this test covers: the hetpipe package and the folders installed inside it."""
    package_dir = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name: repo / folder for name, folder in package_dir.items()
            if name == "hetpipe" or any((repo / folder).glob("*.py"))}


def module_files(roots: dict[str, Path]) -> dict[str, Path]:
    """Every module's dotted name -> its file."""
    modules: dict[str, Path] = {}
    for name, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([name, *parts])] = path
    return modules


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return skipped


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module that ``name`` is, or that defines it: its longest prefix that is one of ours."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """What the statement depends on, as dotted names (resolving a relative import)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = ".".join(p for p in (package, base) if p)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def import_graph(modules: dict[str, Path], repo: Path) -> dict[str, list[Edge]]:
    graph: dict[str, list[Edge]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _type_checking_only(tree)
        edges = []
        for node in ast.walk(tree):
            if id(node) in skipped or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            where = f"{path.relative_to(repo)}:{node.lineno}"
            for name in _imported_names(node, module, path.name == "__init__.py"):
                target = _owner(name, modules)
                if target and target != module:
                    edges.append(Edge(target, where))
        graph[module] = edges
    return graph


def strongly_connected(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """The groups of modules that reach each other (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            edge = next(edges, None)
            if edge is not None:
                if edge.target not in index:
                    index[edge.target] = low[edge.target] = len(index)
                    stack.append(edge.target)
                    on_stack.add(edge.target)
                    work.append((edge.target, iter(graph[edge.target])))
                elif edge.target in on_stack:
                    low[node] = min(low[node], index[edge.target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                groups.append(sorted(group))
    return groups


def one_loop(graph: dict[str, list[Edge]], group: list[str]) -> list[Edge]:
    """A shortest loop through the group's first module, as the imports that make it."""
    members, start = set(group), group[0]
    came_from: dict[str, Edge] = {}
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for edge in graph[node]:
            if edge.target == start:
                path = [edge]
                while node != start:
                    path.append(came_from[node])
                    node = previous[node]
                return path[::-1]
            if edge.target in members and edge.target not in came_from:
                came_from[edge.target], previous[edge.target] = edge, node
                queue.append(edge.target)
    raise AssertionError(f"{group} is no loop")


def describe(start: str, loop: list[Edge]) -> str:
    return start + "".join(f" -> {edge.target} ({edge.where})" for edge in loop)


def loops_in(repo: Path) -> list[str]:
    modules = module_files(package_roots(repo))
    graph = import_graph(modules, repo)
    return [describe(group[0], one_loop(graph, group)) for group in strongly_connected(graph) if len(group) > 1]


def test_no_import_loop():
    loops = loops_in(REPO)
    assert not loops, f"{len(loops)} import loop(s):\n" + "\n".join(loops)


def test_a_loop_is_found_and_named(tmp_path):
    # The check itself: modules that import each other - through a deferred
    # import, through a package's namespace - fail, and the loop is named.
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\nhetpipe = "hetpipe"\n'
                                             '"hetpipe.comm" = "comm"\n')
    files = {"hetpipe/__init__.py": "", "hetpipe/a.py": "def f():\n    import hetpipe.comm.c\n",
             "hetpipe/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import hetpipe.a\n",
             "comm/__init__.py": "", "comm/c.py": "from hetpipe import b\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert loops_in(tmp_path) == []  # b imports a for type checking only
    (tmp_path / "hetpipe/b.py").write_text("import hetpipe.a\n")
    assert loops_in(tmp_path) == ["hetpipe.a -> hetpipe.comm.c (hetpipe/a.py:2) -> hetpipe.b (comm/c.py:1) "
                                  "-> hetpipe.a (hetpipe/b.py:1)"]
