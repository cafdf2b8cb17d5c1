"""The rooms of DESIGN.md §1, checked on the source, without naming files:

- imports point one way: no cycle between modules (lazy and TYPE_CHECKING imports included),
  and the library's folders form layers (`LAYERS`): a folder imports only itself and the
  folders below it; the gateway reaches the engine through its `config` modules alone;
- tools live in tool rooms (packages named in `TOOL_ROOMS`): a runnable module (a `main()` or a
  `__main__` guard) outside them is an entry point (`cli` or `__main__`), and nothing but tools
  and entry points imports a tool;
- one name, one job: two modules (or packages) share a name only when it is a role name
  (`ROLES`), which means the same job in every folder.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# installed as prefixgate.<folder>; lowest layer first: each may import only those before it
LAYERS = ("common", "kernels", "backend", "proxy", "plugins")
ENGINE = ("backend", "kernels")     # reached from the gateway through modules named DOOR only
DOOR = "config"
TOOL_ROOMS = frozenset({"bench", "doctor", "testing", "sim", "tune"})
ENTRY_POINTS = frozenset({"cli", "__main__"})
# names that mean one job wherever they appear: a folder's command line, the `python -m`
# entry, a plugin's class, a side's config schema and parsers, a side's Prometheus metrics
ROLES = frozenset({"__init__", "__main__", "cli", "plugin", "config", "metrics"}) | TOOL_ROOMS


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(("prefixgate", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def imported_modules(tree: ast.AST, package: str, modules) -> set[str]:
    """The modules among `modules` that import statements anywhere in `tree` name (relative
    ones resolved against `package`): `from a import b` is a.b when b is a module, else a."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                         for a in node.names)
    return found & set(modules)


def source_files(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(root, p): p for folder in LAYERS if (root / folder).is_dir()
            for p in sorted((root / folder).rglob("*.py"))}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports. Importing a.b.c runs a.b too, unless a.b is
    a package of the importer's own (that one has started before the importer ran)."""
    files = source_files(root)
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        edges = set()
        for target in imported_modules(ast.parse(path.read_text(encoding="utf-8")), package,
                                       files):
            parts = target.split(".")
            edges.add(target)
            edges.update(".".join(parts[:i]) for i in range(1, len(parts)) if
                         ".".join(parts[:i]) not in own)
        graph[name] = {m for m in edges if m in files and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search)."""
    done, path = set(), []

    def visit(module: str) -> list[str] | None:
        path.append(module)
        for dep in sorted(graph[module]):
            if dep in path:
                return path[path.index(dep):] + [dep]
            if dep not in done and (cycle := visit(dep)):
                return cycle
        done.add(path.pop())
        return None
    for module in sorted(graph):
        if module not in done and (cycle := visit(module)):
            return cycle
    return None


def folder(module: str) -> str:
    return module.split(".")[1]


def is_tool(module: str) -> bool:
    return any(part in TOOL_ROOMS for part in module.split(".")[2:])


def is_entry_point(module: str) -> bool:
    return module.rpartition(".")[2] in ENTRY_POINTS


def layer_breaks(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) for each import of a library module that goes up the layers or
    into the engine by another door than its `config` modules (its folder's package, which
    any of them runs, aside). Tools and entry points sit above every layer."""
    breaks = []
    for module, deps in graph.items():
        if is_tool(module) or is_entry_point(module):
            continue
        rank = LAYERS.index(folder(module))
        for dep in deps:
            there = folder(dep)
            up = LAYERS.index(there) > rank
            side_door = (there in ENGINE and folder(module) not in ENGINE
                         and dep.count(".") > 1 and dep.rpartition(".")[2] != DOOR)
            if up or side_door:
                breaks.append((module, dep))
    return sorted(breaks)


def tool_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, tool module) for every import of a tool from outside the tool rooms and the
    entry points."""
    return sorted((m, dep) for m, deps in graph.items()
                  if not is_tool(m) and not is_entry_point(m) for dep in deps if is_tool(dep))


def runnable(tree: ast.AST) -> bool:
    """Does the module define `main` or run something under `if __name__ == "__main__"`?"""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "main":
            return True
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return True
    return False


def tools_outside_rooms(root: Path = ROOT) -> list[str]:
    return sorted(m for m, path in source_files(root).items()
                  if not is_tool(m) and not is_entry_point(m)
                  and runnable(ast.parse(path.read_text(encoding="utf-8"))))


def shared_names(root: Path = ROOT) -> dict[str, list[str]]:
    """name -> the modules and packages called so, for names that are not role names."""
    by_name: dict[str, list[str]] = {}
    for module in source_files(root):
        by_name.setdefault(module.rpartition(".")[2], []).append(module)
    return {name: mods for name, mods in sorted(by_name.items())
            if len(mods) > 1 and name not in ROLES}


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_go_down_the_layers_and_into_the_engine_by_its_door():
    assert layer_breaks(import_graph()) == []


def test_the_library_imports_no_tool():
    assert tool_imports(import_graph()) == []


def test_runnable_modules_are_tools_or_entry_points():
    assert tools_outside_rooms() == []


def test_one_name_one_job():
    assert shared_names() == {}


def write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_checkers_catch_what_they_forbid(tmp_path):
    write_tree(tmp_path, {
        "proxy/__init__.py": "",
        "proxy/a.py": "from prefixgate.proxy import b\n",
        "proxy/b.py": "def later():\n    from . import a\n",          # lazy and relative
        "proxy/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from prefixgate.proxy.bench.tool import x\n",
        "proxy/bench/__init__.py": "",
        "proxy/bench/tool.py": "import prefixgate.proxy.c\n",            # a tool may import
        "proxy/cli.py": "from prefixgate.proxy.bench import tool\n",     # so may an entry point
        "proxy/runs.py": "if __name__ == '__main__':\n    pass\n",
        "proxy/names.py": "",
        "common/__init__.py": "",
        "common/up.py": "import prefixgate.proxy.names\n",               # up a layer
        "common/names.py": "",
        "backend/__init__.py": "",
        "backend/engine.py": "def main():\n    pass\n",
        "backend/config.py": "",
        "plugins/__init__.py": "",
        "plugins/p.py": "from prefixgate.backend import config, engine\n",   # one side door
    })
    graph = import_graph(tmp_path)
    assert find_cycle(graph) == ["prefixgate.proxy.a", "prefixgate.proxy.b", "prefixgate.proxy.a"]
    assert tool_imports(graph) == [("prefixgate.proxy.c", "prefixgate.proxy.bench"),
                                   ("prefixgate.proxy.c", "prefixgate.proxy.bench.tool")]
    assert layer_breaks(graph) == [("prefixgate.common.up", "prefixgate.proxy"),
                                   ("prefixgate.common.up", "prefixgate.proxy.names"),
                                   ("prefixgate.plugins.p", "prefixgate.backend.engine")]
    assert tools_outside_rooms(tmp_path) == ["prefixgate.backend.engine", "prefixgate.proxy.runs"]
    assert shared_names(tmp_path) == {"names": ["prefixgate.common.names",
                                                "prefixgate.proxy.names"]}
    write_tree(tmp_path, {"proxy/b.py": "", "proxy/c.py": "import prefixgate.proxy.a\n",
                          "proxy/__init__.py": "from prefixgate.proxy import a\n",  # re-export
                          "common/up.py": "",
                          "plugins/p.py": "from prefixgate.backend import config\n"})
    graph = import_graph(tmp_path)
    assert find_cycle(graph) is None and tool_imports(graph) == [] and layer_breaks(graph) == []
