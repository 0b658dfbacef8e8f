"""The explorer page's JavaScript modules (static/app.js and what it imports) as one module script.

The served page loads static/app.js with `<script type="module">`, and the browser fetches what it
imports. An exported file (export-html, attnlab.show in a notebook) cannot import sibling files, so
the exporter inlines the same files, dependencies first: each module becomes a function that returns
its exports, and each `import { a, b } from "./x.js";` becomes `const { a, b } = <x.js's exports>;`.

Design choices:
- The modules stay the one source of truth: only their import lines and `export` keywords are
  rewritten. The grammar is small on purpose: named (or `* as name`) imports of relative paths, one
  per statement at the start of a line, and `export` before a function, const or class declaration.
  Anything else is an error naming the file and the line, so a module the exporter cannot inline
  fails the tests, never a user's export.
- Each module keeps its own scope (a function), as in the browser, and runs once, after the modules
  it imports, as the browser runs them.
- The exports are the values at the module's end, not live bindings: `export let` is refused.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from . import STATIC

ENTRY = "app.js"

_IMPORT = re.compile(
    r"^import\s*(?:\{(?P<names>[^}]*)\}|\*\s*as\s+(?P<star>[\w$]+))"
    r'\s*from\s*"(?P<path>[^"]+)";[ \t]*$',
    re.M,
)
_EXPORT = re.compile(
    r"^export\s+(?:async\s+function\*?|function\*?|const|class)"
    r"\s+(?P<name>[\w$]+)",
    re.M,
)
_STATEMENT = re.compile(r"^(import|export)\b.*$", re.M)


class ModuleError(ValueError):
    """A page module the exporter cannot inline: missing, in a cycle, or a form it does not read."""


def _line(source: str, offset: int) -> int:
    return source.count("\n", 0, offset) + 1


def _resolve(importer: str, spec: str) -> str:
    return posixpath.normpath(posixpath.join(posixpath.dirname(importer), spec))


def _imports(name: str, source: str) -> list[str]:
    """The modules (paths relative to static/) that module `name` imports, in its order."""
    found = []
    for match in _IMPORT.finditer(source):
        if not match["path"].startswith(("./", "../")):
            raise ModuleError(
                f"{name}:{_line(source, match.start())}: imports {match['path']!r}; "
                "the page imports only its own files, by a relative path (./x.js)"
            )
        found.append(_resolve(name, match["path"]))
    return found


def _check_statements(name: str, source: str) -> None:
    understood = {m.start() for pattern in (_IMPORT, _EXPORT) for m in pattern.finditer(source)}
    for match in _STATEMENT.finditer(source):
        if match.start() not in understood:
            where = f"{name}:{_line(source, match.start())}"
            raise ModuleError(
                f"{where}: {match[0][:60]!r} is a form the exporter does not inline;"
                ' use `import { a } from "./x.js";` and `export function` / `const`'
            )


def module_order(entry: str = ENTRY, root: Path = STATIC) -> list[str]:
    """The modules `entry` reaches (paths relative to `root`), each after the modules it imports."""
    order: list[str] = []
    visiting: list[str] = []

    def visit(name: str, importer: str | None) -> None:
        if name in order:
            return
        if name in visiting:
            cycle = " -> ".join(visiting[visiting.index(name) :] + [name])
            raise ModuleError(f"the page's modules import each other in a cycle: {cycle}")
        path = root / name
        if not path.is_file():
            raise ModuleError(f"{importer or 'the page'} imports {name}, which is not in {root}")
        source = path.read_text(encoding="utf-8")
        _check_statements(name, source)
        visiting.append(name)
        for dependency in _imports(name, source):
            visit(dependency, name)
        visiting.pop()
        order.append(name)

    visit(entry, None)
    return order


def inline_modules(entry: str = ENTRY, root: Path = STATIC) -> str:
    """The source of one module script that runs the page's modules as the browser runs them."""
    parts = ["const modules = {};  // path under static/ -> that module's exports"]
    for name in module_order(entry, root):
        source = (root / name).read_text(encoding="utf-8")

        def importing(match: re.Match, name: str = name) -> str:
            exports = f"modules[{_resolve(name, match['path'])!r}]"
            if match["star"]:
                return f"const {match['star']} = {exports};"
            names = [
                re.sub(r"\s+as\s+", ": ", n.strip()) for n in match["names"].split(",") if n.strip()
            ]
            return f"const {{ {', '.join(names)} }} = {exports};"

        exported = [m["name"] for m in _EXPORT.finditer(source)]
        body = re.sub(r"^export\s+", "", _IMPORT.sub(importing, source), flags=re.M)
        parts.append(
            f"// ---- {name}\nmodules[{name!r}] = (() => {{\n{body.rstrip()}\n"
            f"return {{ {', '.join(exported)} }};\n}})();"
        )
    return "\n".join(parts) + "\n"
