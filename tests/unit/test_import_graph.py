"""The package's module-level imports form no cycle (an import inside a function is a deliberate
late binding and is not counted). Read from the source with `ast`: nothing is imported."""
import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "megatron_rl")


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: str, known: set[str]) -> set[str]:
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        for n in node.body if isinstance(node, ast.If) else [node]:  # `if TYPE_CHECKING:` blocks too
            if isinstance(n, ast.Import):
                out |= {a.name for a in n.names if a.name in known}
            elif isinstance(n, ast.ImportFrom) and n.module:
                base = n.module if n.level == 0 else ".".join(package.split(".")[:len(package.split(".")) - n.level + 1]
                                                              + [n.module])
                for a in n.names:
                    full = f"{base}.{a.name}"
                    out.add(full if full in known else base)
    return out & known


def test_no_import_cycle():
    modules = _modules()
    graph = {m: _imports(m, p, set(modules)) for m, p in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n] if n in path else [m, n]
            if n not in state and (cycle := visit(n, path + [n])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m, [m])
            assert cycle is None, "import cycle: " + " -> ".join(cycle)
