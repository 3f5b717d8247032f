"""The package's import graph (every import, lazy ones inside functions too, read with `ast`):
no module imports itself back through others, and no layer imports one above it."""

import ast
import os

import leapdecode

SRC = os.path.dirname(leapdecode.__file__)
# from the bottom up: a module may import its own layer's (without a circle) and those below
LAYERS = (
    {"errors", "cache", "memory", "config", "paths", "threads", "metrics", "sampling", "tree",
     "verify", "sequence", "code_edits", "cli_args", "proposers.registry"},  # the core
    {"models", "speculators_export", "resolve", "pull"},
    {"proposers", "integrations"},
    {"engine"},
    {"api", "frontend", "chat"},
    {"server", "train"},
    {"bench"},
    {"demo"},
    {"cli", "__main__", ""},  # "": the package's own __init__
)  # fmt: skip


def modules() -> dict[str, str]:
    """Dotted name below leapdecode ("engine.engine", "" for the package) -> file."""
    out = {}
    for folder, _, files in os.walk(SRC):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, SRC)[:-3].replace(os.sep, ".")
                out[name.removesuffix("__init__").rstrip(".")] = path
    return out


def imports(mods: dict[str, str]) -> dict[str, set[str]]:
    """Each module's leapdecode imports, as module names (a name imported from a package that
    is a module of it counts as that module)."""
    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod.split(".") if path.endswith("__init__.py") else mod.split(".")[:-1]
        package = [p for p in package if p]
        for node in ast.walk(ast.parse(open(path).read())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == "leapdecode"]
                targets = [t.removeprefix("leapdecode").lstrip(".") for t in targets]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                elif (node.module or "").split(".")[0] == "leapdecode":
                    target = node.module.removeprefix("leapdecode").lstrip(".")
                else:
                    continue
                targets = [f"{target}.{a.name}".lstrip(".") for a in node.names]
                targets = [t if t in mods else target for t in targets]
            for t in targets:
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != mod:
                    graph[mod].add(t)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def layer(mod: str) -> int:
    """The layer of a module, or of the package above it that LAYERS places (nearest first)."""
    parts = mod.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        for i, names in enumerate(LAYERS):
            if name in names:
                return i
    raise KeyError(mod)


def test_no_import_circles():
    graph = imports(modules())
    assert sum(len(v) for v in graph.values()) > 100  # the reader found the imports
    assert circles(graph) == []


def test_no_upward_imports():
    mods = modules()
    unplaced = sorted({m.split(".")[0] for m in mods} - set().union(*LAYERS))
    assert unplaced == [], f"place these in LAYERS: {unplaced}"
    upward = [f"{a} -> {b}" for a, deps in imports(mods).items() for b in deps
              if layer(b) > layer(a)]  # fmt: skip
    assert upward == []


def test_the_checker_finds_a_circle_and_an_upward_import():
    graph = {"engine.engine": {"engine.planner"}, "engine.planner": {"engine.engine"},
             "models.llama": {"api"}, "api": set()}  # fmt: skip
    assert circles(graph) == [["engine.engine", "engine.planner"]]
    assert layer("models.llama") < layer("api")


def test_the_planner_neither_imports_nor_holds_the_engine(decoder):
    """The planner plans from the proposers, the target's step traits and the cost model it
    is given: it imports no engine module and keeps no reference to the engine."""
    from leapdecode.engine.engine import Engine

    graph = imports(modules())
    assert "engine.engine" not in graph["engine.planner"]
    held = vars(decoder.engine.planner).values()
    assert not any(isinstance(v, Engine) for v in held)
    assert decoder.engine.planner.proposers is decoder.engine.proposers


def test_the_http_process_loads_no_engine_model_or_proposer_code():
    """The server's HTTP process checks requests with the config and the method registry
    (registry.check and the engine's capabilities); the engine, the models and the proposers
    load in the engine's process only."""
    import subprocess
    import sys

    code = (
        "import sys, leapdecode.server.app, leapdecode.server.command\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('leapdecode'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert "leapdecode.proposers.registry" in loaded and "leapdecode.config" in loaded
    heavy = [m for m in loaded if (m.split(".") + [""])[1] in ("engine", "models", "api")]
    heavy += [
        m
        for m in loaded
        if m.startswith("leapdecode.proposers.") and m != "leapdecode.proposers.registry"
    ]
    assert heavy == []
