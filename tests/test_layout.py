"""The package's layout keeps its rules (docs/layout.md): arrows between the packages point one way, the model takes
its reductions from outside, the rank's engine knows no transport, the front-end and the client need no torch, no
import circle, benches import no tests, and every result file is cited by its full path. Read from the source text
(imports, top-level and inside functions alike), so a rule breaks here before it breaks a reader."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "dspark_ray")


def _modules() -> dict[str, str]:
    """dotted module name -> path, for every module of the package."""
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The package's modules `name` imports anywhere in its text (a name imported from a package that is a module
    of it counts as that module)."""
    path = MODULES[name]
    pkg = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for a in node.names:
                out.add(f"{src}.{a.name}" if f"{src}.{a.name}" in MODULES else src)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {m: _imports(m) for m in MODULES}


def _under(name: str, *packages: str) -> bool:
    return any(name == f"dspark_ray.{p}" or name.startswith(f"dspark_ray.{p}.") for p in packages)


def test_the_model_imports_nothing_of_the_collectives_backends_or_the_rank():
    bad = {m: sorted(d for d in deps if _under(d, "comm", "rank", "frontend", "transport"))
           for m, deps in GRAPH.items() if _under(m, "model")}
    assert not any(bad.values()), bad


def test_only_the_ranks_ring_loop_imports_a_transport():
    bad = {m: sorted(d for d in deps if _under(d, "transport"))
           for m, deps in GRAPH.items() if _under(m, "rank") and m != "dspark_ray.rank.worker"}
    assert not any(bad.values()), bad


def test_no_import_circle():
    """Tarjan's strongly connected components over every import of the package: none holds two modules."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(GRAPH)))
    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not found, found


@pytest.mark.parametrize("module", ["dspark_ray.actors.frontend", "dspark_ray.client"])
def test_the_front_end_and_the_client_import_no_torch(module):
    code = f"import sys; sys.modules['torch'] = None\nimport {module}\nprint('ok')"   # importing torch now raises
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_the_public_client_names_are_where_the_readme_shows_them():
    import dspark_ray.client as client
    from dspark_ray.client.drafter_client import ClientError, DrafterClient
    from dspark_ray.client.pool import DrafterPool
    from dspark_ray.protocol.contract import Code
    assert (client.DrafterClient, client.DrafterPool, client.ClientError, client.Code) == \
        (DrafterClient, DrafterPool, ClientError, Code)
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "from dspark_ray.client import DrafterClient" in readme and "`dspark_ray.client.Code`" in readme


def test_no_bench_or_tool_puts_tests_on_the_path_or_imports_a_bench():
    bad = []
    for d in ("bench", "tools"):
        for f in sorted(os.listdir(os.path.join(ROOT, d))):
            if f.endswith(".py"):
                text = open(os.path.join(ROOT, d, f)).read()
                if re.search(r"""sys\.path\.insert\([^)]*["']tests["']""", text) or \
                        re.search(r"^\s*from support\b", text, re.M) or \
                        (d == "tools" and re.search(r"^\s*(from|import) bench\b", text, re.M)):
                    bad.append(f"{d}/{f}")
    assert not bad, bad


def test_every_result_file_is_cited_by_its_full_path():
    files = subprocess.run(["git", "ls-files", "bench/results"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    docs = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "bench", "README.md")] + \
        [os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")]
    text = "".join(open(p).read() for p in docs)
    uncited = [f for f in files if f not in text]
    assert not uncited, f"{len(uncited)} of {len(files)} result files cited nowhere by full path: {uncited[:10]}"
