"""The import graph of `vllm_omni` has no cycle, and the runtime reaches model families only through
`diffusion/models/registry.py` and `interface.py`.

Every `import` / `from ... import` statement of every module counts, wherever it sits (module level,
inside a function, under `TYPE_CHECKING`): a function-level import (or a lazy module `__getattr__`)
hides a cycle from Python's import machinery, not from a reader. An edge goes to the module named (or to
`package.name` when that is a module itself), and to the `__init__` of every package it enters from
outside (Python runs it first; `sched/__init__.py`'s lazy `__getattr__` hid such a cycle), except the
top-level `vllm_omni/__init__.py`, the public front door.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_omni

PACKAGE_ROOT = Path(vllm_omni.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The `vllm_omni` modules `path` imports anywhere in its body."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                out.add(target if target in modules else base)
    entered = set()
    for target in out:
        parts = target.split(".")
        for i in range(2, len(parts)):  # vllm_omni.x, vllm_omni.x.y, ... (not vllm_omni itself)
            package = ".".join(parts[:i])
            if name != package and not name.startswith(package + "."):
                entered.add(package)  # entering the package from outside runs its __init__ first
    return {m for m in out | entered if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    """module -> the `vllm_omni` modules it imports."""
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative DFS, three colours)."""
    colour = dict.fromkeys(graph, 0)  # 0 new, 1 on the stack, 2 done
    for root in sorted(graph):
        if colour[root]:
            continue
        stack = [(root, iter(sorted(graph[root])))]
        path = [root]
        colour[root] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour[child] == 1:
                return [*path[path.index(child) :], child]
            elif colour[child] == 0:
                colour[child] = 1
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
    return None


def test_find_cycle_finds_a_function_level_cycle(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_vllm_omni_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_runtime_reaches_families_only_through_registry_and_interface():
    """Outside `diffusion/models/`, no module imports a family folder (nor names one)."""
    families = {p.name for p in (PACKAGE_ROOT / "diffusion" / "models").iterdir() if p.is_dir()}
    families.discard("__pycache__")
    assert families >= {"qwen_image", "qwen_image_edit"}
    offenders = []
    for name, imported in import_graph().items():
        if name.startswith("vllm_omni.diffusion.models"):
            continue
        offenders += [f"{name} -> {m}" for m in imported if m.startswith("vllm_omni.diffusion.models.")]
        text = _modules()[name].read_text(encoding="utf-8")
        offenders += [f"{name} names {f}" for f in families if f in text]
    allowed = {"vllm_omni.diffusion.models.registry", "vllm_omni.diffusion.models.interface"}
    offenders = [o for o in offenders if o.split(" -> ")[-1] not in allowed]
    assert offenders == []
