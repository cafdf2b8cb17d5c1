"""The import rules of DESIGN.md §1, checked on the source: imports point one way (no cycles,
lazy and TYPE_CHECKING imports included) and nothing outside the tool rooms imports a tool."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("common", "proxy", "plugins", "backend", "kernels", "conf")     # installed as prefixgate.<folder>
TOOL_ROOMS = ("prefixgate.proxy.bench", "prefixgate.proxy.doctor", "prefixgate.proxy.testing",
              "prefixgate.plugins.sim", "prefixgate.kernels.bench", "prefixgate.backend.bench",
              "prefixgate.backend.bench.kv_handover", "prefixgate.backend.bench.speculative",
              "prefixgate.backend.bench.offload")


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


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports. Importing a.b.c runs a.b too, unless a.b is
    a package of the importer's own (that one has started before the importer ran)."""
    files = {module_name(root, p): p for folder in FOLDERS if (root / folder).is_dir()
             for p in sorted((root / folder).rglob("*.py"))}
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


def is_tool(module: str) -> bool:
    return any(module == room or module.startswith(room + ".") for room in TOOL_ROOMS)


def tool_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, tool module) for every import of a tool from outside the tool rooms."""
    return sorted((m, dep) for m, deps in graph.items() if not is_tool(m)
                  for dep in deps if is_tool(dep))


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_request_path_imports_no_tool():
    assert tool_imports(import_graph()) == []


def test_checker_catches_a_cycle_and_a_tool_import(tmp_path):
    files = {
        "proxy/__init__.py": "",
        "proxy/a.py": "from prefixgate.proxy import b\n",
        "proxy/b.py": "def later():\n    from . import a\n",          # lazy and relative
        "proxy/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from prefixgate.proxy.bench.tool import x\n",
        "proxy/bench/__init__.py": "",
        "proxy/bench/tool.py": "import prefixgate.proxy.c\n",            # a tool may import
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert find_cycle(graph) == ["prefixgate.proxy.a", "prefixgate.proxy.b", "prefixgate.proxy.a"]
    assert tool_imports(graph) == [("prefixgate.proxy.c", "prefixgate.proxy.bench"),
                                   ("prefixgate.proxy.c", "prefixgate.proxy.bench.tool")]
    (tmp_path / "proxy/b.py").write_text("")
    (tmp_path / "proxy/__init__.py").write_text("from prefixgate.proxy import a\n")  # re-export
    (tmp_path / "proxy/c.py").write_text("import prefixgate.proxy.a\n")
    graph = import_graph(tmp_path)
    assert find_cycle(graph) is None and tool_imports(graph) == []
