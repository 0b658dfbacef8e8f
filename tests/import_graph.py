"""The package's import graph, read from its own source with `ast`: `python tests/import_graph.py`
prints it.

- A module is a file of src/attnlab (a package is its __init__.py). An arrow A -> B is an import in
  A that
  names B (`from .x import f`, `from . import x`, `import attnlab.x`); `from pkg import name`, where
  name is no submodule, is an arrow to pkg. An import inside a function is deferred: it runs when
  the function is called, not when A is imported. Imports under `if TYPE_CHECKING:` are neither
  (they never run).
- A circle is a set of modules that import each other in a loop, deferred imports included: a
  deferred import that closes a loop only hides the circle, it does not open it.
- A room is what the package's folder shows: each subpackage of attnlab (model/, lens/, ...) is one
  room, each module at the top one room; an arrow between rooms stands for every import between
  their modules.
  Levels: the arrows of imports that run at import time, then each arrow of deferred imports alone
  (in name order) where it closes no loop of rooms; a room's level is 1 when it has none of these
  arrows, else one more than the highest room they reach. An arrow left out (a deferred import that
  closes a loop of rooms, whose modules need not form a circle) runs up: from a lower level to a
  higher one.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "attnlab"
SOURCE = Path(__file__).resolve().parent.parent / "src" / PACKAGE


@dataclass
class Graph:
    modules: dict[str, Path]
    # module -> modules it imports when it is imported
    load: dict[str, set[str]] = field(default_factory=dict)
    # module -> {module: line} inside functions
    deferred: dict[str, dict[str, int]] = field(default_factory=dict)

    def arrows(self) -> dict[str, set[str]]:
        return {m: self.load[m] | set(self.deferred[m]) for m in self.modules}


def module_name(path: Path, root: Path = SOURCE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module):
    """(node, deferred) for every import in the tree, skipping `if TYPE_CHECKING:` blocks."""

    def walk(node: ast.AST, deferred: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, deferred
            inner = deferred or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            yield from walk(child, inner)

    yield from walk(tree, False)


def read(root: Path = SOURCE) -> Graph:
    modules = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph = Graph(modules)
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        graph.load[name], graph.deferred[name] = set(), {}
        for node, deferred in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    targets.append(sub if sub in modules else module)
            for target in targets:
                # `import attnlab.x.y` of a name, not a module
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name and target.split(".")[0] == PACKAGE:
                    if deferred:
                        graph.deferred[name].setdefault(target, node.lineno)
                    else:
                        graph.load[name].add(target)
    return graph


def circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in arrows.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    sys.setrecursionlimit(10_000)
    for v in sorted(arrows):
        if v not in index:
            visit(v)
    return sorted(found)


def room_of(module: str) -> str:
    """The room a module is in: attnlab.model.attention -> attnlab.model; attnlab.cli ->
    attnlab.cli."""
    parts = module.split(".")
    return ".".join(parts[:2])


def rooms(graph: Graph) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(load-time arrows, all arrows) between rooms."""
    load: dict[str, set[str]] = {room_of(m): set() for m in graph.modules}
    every: dict[str, set[str]] = {room: set() for room in load}
    for m in graph.modules:
        for target in graph.load[m]:
            if room_of(target) != room_of(m):
                load[room_of(m)].add(room_of(target))
                every[room_of(m)].add(room_of(target))
        for target in graph.deferred[m]:
            if room_of(target) != room_of(m):
                every[room_of(m)].add(room_of(target))
    return load, every


def levels(arrows: dict[str, set[str]]) -> dict[str, int]:
    """Level of each node: 1 + the highest level it points to (1 for none); the nodes of a circle
    share one."""
    group = {v: tuple(c) for c in circles(arrows) for v in c}
    found: dict[str, int] = {}

    def level(v: str) -> int:
        if v not in found:
            members = group.get(v, (v,))
            for m in members:
                found[m] = 0  # being computed: an arrow back into the circle adds nothing
            top = max((level(w) for m in members for w in arrows[m] if w not in members), default=0)
            for m in members:
                found[m] = 1 + top
        return found[v]

    for v in arrows:
        level(v)
    return found


@dataclass
class Measure:
    circles: list[list[str]]  # of modules
    room_circles: list[list[str]]  # of rooms, at import time
    room_levels: dict[str, int]
    up: list[tuple[str, str]]  # room arrows from a level to the same or a higher one
    deferred: list[tuple[str, str, int]]  # (module, module it imports inside a function, line)

    @property
    def n_levels(self) -> int:
        return max(self.room_levels.values())


def _reaches(arrows: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v == goal:
            return True
        if v not in seen:
            seen.add(v)
            todo.extend(arrows[v])
    return False


def measure(root: Path = SOURCE) -> Measure:
    graph = read(root)
    load, every = rooms(graph)
    room_circles = circles(load)
    ordered = {room: set(targets) for room, targets in load.items()}
    up = []
    for a in sorted(every):
        for b in sorted(every[a] - load[a]):
            if _reaches(ordered, b, a):
                up.append((a, b))
            else:
                ordered[a].add(b)
    room_levels = levels(ordered)
    # only in a circle of rooms
    up += [(a, b) for a in load for b in load[a] if room_levels[b] >= room_levels[a]]
    deferred = sorted((m, t, line) for m in graph.deferred for t, line in graph.deferred[m].items())
    return Measure(circles(graph.arrows()), room_circles, room_levels, sorted(up), deferred)


def main() -> int:
    found = measure()
    by_level: dict[int, list[str]] = {}
    for room, level in found.room_levels.items():
        by_level.setdefault(level, []).append(room)
    print(
        f"{len(found.room_levels)} rooms on {found.n_levels} levels, {len(found.circles)} circles, "
        f"{len(found.up)} arrows up, {len(found.deferred)} deferred imports inside the package"
    )
    for level in sorted(by_level, reverse=True):
        print(f"level {level}: {', '.join(sorted(by_level[level]))}")
    for members in found.circles:
        print("circle:", " <-> ".join(members))
    for members in found.room_circles:
        print("circle of rooms at import time:", " <-> ".join(members))
    for a, b in found.up:
        print(f"up: {a} -> {b}")
    for m, t, line in found.deferred:
        print(f"deferred: {m}:{line} -> {t}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
