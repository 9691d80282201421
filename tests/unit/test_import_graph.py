"""The package's imports form no cycle and respect its layers. Read from the source with `ast`:
nothing is imported.

Every import counts, at the top of a module or inside a function (a function-local import is
still a dependency, only a later one), and importing `a.b.c` counts as importing the packages
`a.b` and `a` too, because Python runs their `__init__` first: `from megatron_rl.config import
checks` imports the whole config package."""
import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "megatron_rl")

# the layers, bottom first (docs/architecture.md, "Layers"): a module imports only modules of its own
# row or the rows before it. The config row is below rollout and trainer (they register with it);
# configure, which checks the rules across them all, is above both.
ROWS = (
    ("checks", "registry", "plugins", "fs", ""),   # "": the package's own __init__
    ("model", "parallel", "platform", "precision"),
    ("losses", "logprobs", "metrics"),
    ("moe",),
    ("data", "rewards"),
    ("config",),
    ("rollout",),
    ("trainer",),
    ("configure",),
)


def _row(module: str) -> int:
    """The row of `module` (a megatron_rl module): that of the longest package prefix listed."""
    rel = module.removeprefix("megatron_rl").removeprefix(".")
    best = max(((len(p), i) for i, row in enumerate(ROWS) for p in row if rel == p or rel.startswith(p + ".")
                or p == ""), default=None)
    assert best is not None, f"{module}: in no row of ROWS"
    return best[1]


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def _parents(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _imports(name: str, path: str, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` (file `path`) imports anywhere, with their parent
    packages; its own parent packages are left out (they are running already)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    with open(path) as f:
        tree = ast.parse(f.read())
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module:
            base = n.module if n.level == 0 else ".".join(package.split(".")[:len(package.split(".")) - n.level + 1]
                                                          + [n.module])
            for a in n.names:
                full = f"{base}.{a.name}"
                out.add(full if full in known else base)
    out |= {p for m in out for p in _parents(m)}
    return (out & known) - _parents(name) - {name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, set(modules)) for m, p in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
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
        if m not in state and (cycle := visit(m, [m])):
            return cycle
    return None


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_function_local_imports_and_parent_packages_count():
    """The reader sees what the old one skipped: an import inside a function, and the package
    `__init__` that importing a submodule runs."""
    graph = _graph()
    assert "megatron_rl.rollout.function" in graph["megatron_rl.configure.plugins"]  # top-level import
    assert "megatron_rl.config" in graph["megatron_rl.rollout.engine"]  # via config.engine_sections
    toy = {"a": {"b"}, "b": {"a"}}
    assert _cycle(toy) in (["a", "b", "a"], ["b", "a", "b"])


def test_layers():
    wrong = sorted((m, n) for m, deps in _graph().items() for n in deps if _row(n) > _row(m))
    assert not wrong, "imports against the layers: " + "; ".join(f"{m} -> {n}" for m, n in wrong)


def test_the_layer_reader_sees_a_back_arrow():
    assert _row("megatron_rl.config.schema") < _row("megatron_rl.rollout.engine") < _row("megatron_rl.configure")
    assert _row("megatron_rl.checks") == 0 and _row("megatron_rl") == 0


def test_the_serving_layer_does_not_import_an_engine():
    """rollout/serving is engine-agnostic: a server kind plugs into it as a dialect, so nothing in
    it imports the vLLM backend (which imports it)."""
    graph = _graph()
    serving = [m for m in graph if m == "megatron_rl.rollout.serving" or m.startswith("megatron_rl.rollout.serving.")]
    assert "megatron_rl.rollout.serving.dialect" in serving
    wrong = sorted((m, n) for m in serving for n in graph[m] if n.startswith("megatron_rl.rollout.vllm"))
    assert not wrong, "the serving layer imports an engine: " + "; ".join(f"{m} -> {n}" for m, n in wrong)
    assert "megatron_rl.rollout.serving.dialect" in graph["megatron_rl.rollout.vllm.protocol"]  # the other way round
