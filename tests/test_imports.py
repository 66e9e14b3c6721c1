"""The import graph of `dblock`: every module imports in a fresh interpreter, and no two modules import each other,
directly or through others (module-level imports and imports inside functions alike)."""
import ast
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "dblock")

#: modules not imported by the import test, each with the reason (nothing is skipped silently)
NOT_IMPORTED = {
    "dblock.__main__": "runs the `dblock` command and exits on import",
}

#: modules that need an optional dependency at import: imported only when it is installed (module -> distribution)
OPTIONAL = {
    "dblock.kernels": "triton",
    "dblock.kernels.align": "triton",
    "dblock.kernels.attention": "triton",
    "dblock.kernels.compact": "triton",
    "dblock.kernels.grouped_mlp": "triton",
    "dblock.kernels.lm_head": "triton",
    "dblock.kernels.route": "triton",
    "dblock.kernels.stack": "triton",
    "dblock.serving.server": "fastapi",
    "dblock.serving.metrics": "prometheus_client",
    "dblock.serving.protocol": "pydantic",
    "dblock.serving.chat": "jinja2",
    **{f"dblock.serving.{m}": "pydantic" for m in ("protocol_base", "protocol_chat", "protocol_completion",
                                                   "protocol_models", "protocol_prompt", "protocol_sampling",
                                                   "protocol_tokenize")},
    **{f"dblock.serving.{m}": "fastapi" for m in ("launcher", "receiving", "responses", "streaming",
                                                  "serving_chat", "serving_completion", "serving_engine",
                                                  "serving_models", "serving_tokenization")},
}


def module_files() -> dict:
    """{module name: file} for every .py file under dblock/ (packages as their __init__)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(PKG):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, fn), ROOT)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(dirpath, fn)
    return out


def test_every_module_imports_in_one_fresh_interpreter():
    names = []
    for name in sorted(module_files()):
        if name in NOT_IMPORTED:
            continue
        dep = OPTIONAL.get(name)
        if dep is not None and importlib.util.find_spec(dep) is None:
            print(f"not imported: {name} (needs {dep}, not installed)")
            continue
        names.append(name)
    script = (
        "import importlib, json, sys, traceback\n"
        "failed = []\n"
        "for name in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except BaseException:\n"
        "        failed.append([name, traceback.format_exc(limit=-4)])\n"
        "print(json.dumps(failed))\n")
    res = subprocess.run([sys.executable, "-c", script, json.dumps(names)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    failed = json.loads(res.stdout.strip().splitlines()[-1])
    assert not failed, "modules that fail to import (in sorted order, one interpreter):\n" + "\n".join(
        f"--- {name}\n{tb}" for name, tb in failed)


# ---------------------------------------------------------------------------------------------------------------
# static import graph
# ---------------------------------------------------------------------------------------------------------------

def _known(name: str, modules) -> str | None:
    """`name` if it is a dblock module, else its longest prefix that is one (`dblock.x.Thing` -> `dblock.x`)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_edges(modules: dict) -> dict:
    """{module: {imported dblock module: [line, ...]}} from every import statement anywhere in each file."""
    edges = {}
    for mod, path in modules.items():
        is_pkg = os.path.basename(path) == "__init__.py"
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        out = edges.setdefault(mod, {})

        def add(target, line):
            t = _known(target, modules)
            if t is not None and t != mod:
                out.setdefault(t, []).append(line)

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "dblock" or alias.name.startswith("dblock."):
                        add(alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".")
                    base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if not (source == "dblock" or source.startswith("dblock.")):
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    add(sub if sub in modules else source, node.lineno)
    return edges


def strongly_connected(edges: dict) -> list:
    """Tarjan's strongly connected components (iterative)."""
    index, low, on_stack, stack, comps, counter = {}, {}, set(), [], [], [0]
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    comps.append(sorted(comp))
    return comps


def a_cycle(comp: list, edges: dict) -> list:
    """One cycle through the component's first module (breadth-first, so the shortest)."""
    members, start = set(comp), comp[0]
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def test_graph_helpers_find_a_cycle():
    edges = {"a": {"b": [1]}, "b": {"c": [2]}, "c": {"a": [3], "d": [4]}, "d": {}}
    comps = [c for c in strongly_connected(edges) if len(c) > 1]
    assert comps == [["a", "b", "c"]]
    assert a_cycle(comps[0], edges) == ["a", "b", "c", "a"]
    assert a_cycle(["a", "b"], {"a": {"b": [1]}, "b": {"a": [2]}}) == ["a", "b", "a"]


def test_import_resolution():
    mods = module_files()
    edges = import_edges(mods)
    assert "dblock.cli_args" in edges["dblock.cli"]                          # from dblock.cli_args import ...
    assert "dblock.cli.serving" in edges["dblock.cli"]                       # from dblock.cli import serving
    assert "dblock.tasks.arith" in edges["dblock.tasks"]                     # from .arith import ... (in __init__)


def test_no_import_cycles():
    modules = module_files()
    edges = import_edges(modules)
    comps = [c for c in strongly_connected(edges) if len(c) > 1]
    lines = []
    for comp in comps:
        cyc = a_cycle(comp, edges)
        steps = ", ".join(f"{a} -> {b} (line {edges[a][b][0]})" for a, b in zip(cyc, cyc[1:]))
        lines.append(f"{len(comp)} modules {comp}: cycle {' -> '.join(cyc)}: {steps}")
    assert not comps, "import cycles among dblock modules:\n" + "\n".join(lines)
