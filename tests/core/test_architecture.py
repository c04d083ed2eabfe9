"""The layering docs/architecture.md draws: no import cycle between ernie_serve's packages (every import
counted, lazy ones inside functions too), and the engine's core imports no framework."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "backend" / "ernie_serve"


def _node(module: str) -> str:
    """A subpackage (engine, model, ...) is one node; a module at the top (config, step_contract) is its own."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (ROOT / parts[1]).is_dir() else ".".join(parts[:2])


def _imports(path: Path, module: str) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
            prefix = ".".join(base + ([node.module] if node.module else []))
            out |= {prefix} if node.module else {f"{prefix}.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ernie_serve"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("ernie_serve")}
    return out


def package_graph() -> dict[str, dict[str, set[str]]]:
    """node -> node it imports -> the module-level imports that make the edge."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        src = _node(module)
        for target in _imports(path, module):
            dst = _node(target)
            if dst != src and dst != "ernie_serve":
                graph.setdefault(src, {}).setdefault(dst, set()).add(f"{module} -> {target}")
    return graph


def _cycles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
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

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_packages():
    graph = package_graph()
    assert "engine" in graph and "model" in graph  # the graph is read at all
    cycles = _cycles(graph)
    detail = [f"{a} -> {b}: {sorted(graph[a][b])[:3]}" for c in cycles for a in c for b in c if b in graph.get(a, {})]
    assert not cycles, "\n".join(detail)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b": {"x"}}, "b": {"c": {"y"}}, "c": {"a": {"z"}}, "d": {"a": {"w"}}}) == [["a", "b", "c"]]


def test_the_engine_core_imports_no_framework():
    code = ("import sys, ernie_serve.engine.llm_engine, ernie_serve.engine.async_engine, ernie_serve.engine.scheduler, "
            "ernie_serve.engine.model_runner, ernie_serve.engine.sampler, ernie_serve.engine.mtp_drafter, "
            "ernie_serve.engine.executor_factory, ernie_serve.step_contract; "
            "print(sorted(m for m in ('paddle', 'torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_models_structure_names_no_weight_format():
    """The decoder's modules get their linears and experts from the LayerBuilder the loader hands in
    (model/layer_builder.py); none of them imports the quantized layers, even lazily, so a new weight format is a
    new builder and not an edit to the model."""
    structure = ["ernie", "layers", "moe", "attention", "mtp", "layer_builder"]
    for name in structure:
        imports = _imports(ROOT / "model" / f"{name}.py", f"ernie_serve.model.{name}")
        assert not {i for i in imports if "quantized_layers" in i or i.startswith("ernie_serve.quantization")}, name
