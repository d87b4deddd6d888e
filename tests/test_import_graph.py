"""The import graph of `vllm_omni` has no cycle, and the runtime reaches model families only through
`diffusion/models/registry.py`, `interface.py` and `plans.py`; outside `diffusion/models/` no code names
a family's modules or pipeline classes, and none probes a model object with `getattr` / `hasattr`.

Every `import` / `from ... import` statement of every module counts, wherever it sits (module level,
inside a function, under `TYPE_CHECKING`): a function-level import (or a lazy module `__getattr__`)
hides a cycle from Python's import machinery, not from a reader. An edge goes to the module named (or to
`package.name` when that is a module itself), and to the `__init__` of every package it enters from
outside (Python runs it first; `sched/__init__.py`'s lazy `__getattr__` hid such a cycle), except the
top-level `vllm_omni/__init__.py`, the public front door.
"""

from __future__ import annotations

import ast
import re
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
    allowed = {
        "vllm_omni.diffusion.models.registry",
        "vllm_omni.diffusion.models.interface",
        "vllm_omni.diffusion.models.plans",
    }
    offenders = [o for o in offenders if o.split(" -> ")[-1] not in allowed]
    assert offenders == []


# ---- families as data: no model names, no capability probes outside diffusion/models/ ----------------

MODELS_DIR = PACKAGE_ROOT / "diffusion" / "models"
EXAMPLE_COMMAND_LINES = {"vllm_omni.entrypoints.cli.upstream_flags"}
"""vLLM-Omni's example command lines (`--model-class-name QwenImagePipeline`, `ignored_layers`), quoted."""
MODULE_NAMES = {
    "img_mlp",
    "txt_mlp",
    "img_mod",
    "txt_mod",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "transformer_blocks",
    "time_text_embed",
    "norm_out",
    "proj_out",
    "txt_in",
    "img_in",
    "txt_norm",
    "modulation",
    "gate_layer",
    "RMSNorm",
    "ZeroCenterRMSNorm",
}
"""Module and class names of the served families' transformers (a sample; `_family_names` adds every
name their plans declare)."""
MODEL_OBJECTS = ("pipeline", "transformer", "family", "model")
"""Names of model objects: a `getattr` / `hasattr` whose object mentions one probes a capability."""


def _family_names() -> set[str]:
    """MODULE_NAMES, every dotted part (of 5+ characters, with an underscore) the families' plans
    (`models/<family>/plans.py`) name, their norm classes, and the registered pipeline classes."""
    import importlib

    from vllm_omni.diffusion.models import registry
    from vllm_omni.diffusion.models.plans import TransformerPlans

    names = set(MODULE_NAMES) | set(registry.PIPELINES)
    for path in sorted(MODELS_DIR.glob("*/plans.py")):
        module = importlib.import_module(_module_name(path))
        for plans in (v for v in vars(module).values() if isinstance(v, TransformerPlans)):
            patterns = list(plans.quant_kept_layers or ()) + [plans.blocks]
            if plans.lora is not None:
                patterns += [*plans.lora.seq_modules, *plans.lora.txt_modules, *plans.lora.block_targets]
            if plans.tensor_parallel is not None:
                patterns += [s.path for s in plans.tensor_parallel.shards]
            names |= {p for pattern in patterns for p in pattern.split(".") if len(p) >= 5 and "_" in p}
            names |= {cls.__name__ for cls in plans.invariant_norms}
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants (module, class, function) and attribute docstrings."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for stmt in body:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                out.add(id(stmt.value))
    return out


def _runtime_modules():
    """(module name, source) of every module outside `diffusion/models/` (and the quoted examples)."""
    for name, path in _modules().items():
        if path.is_relative_to(MODELS_DIR) or name in EXAMPLE_COMMAND_LINES:
            continue
        yield name, path.read_text(encoding="utf-8")


WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def name_uses(module: str, text: str, names: set[str]) -> list[str]:
    """'module:line name' for each of `names` used as code in `text`: an identifier, an attribute, or a
    word of a string literal (docstrings and comments, which may cite diffusers' classes, excepted)."""
    tree, found = ast.parse(text), []
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            words = {node.attr}
        elif isinstance(node, ast.Name):
            words = {node.id}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words = set(WORD.findall(node.value))
        else:
            continue
        found += [f"{module}:{node.lineno} {w}" for w in sorted(words & names)]
    return found


def probes(module: str, text: str) -> list[str]:
    """'module:line source' for each `getattr` / `hasattr` in `text` whose object is a model object."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
        ):
            target = ast.get_source_segment(text, node.args[0]) or ""
            if any(obj in target.lower() for obj in MODEL_OBJECTS):
                found.append(f"{module}:{node.lineno} {ast.get_source_segment(text, node)}")
    return found


def model_name_uses() -> list[str]:
    """Family module / class names and pipeline class names used as code outside `diffusion/models/`."""
    names = _family_names()
    return [use for name, text in _runtime_modules() for use in name_uses(name, text, names)]


def model_probes() -> list[str]:
    """`getattr` / `hasattr` probes of model objects outside `diffusion/models/`."""
    return [probe for name, text in _runtime_modules() for probe in probes(name, text)]


def test_the_checks_find_names_and_probes():
    names = _family_names()
    assert {"img_mlp", "add_q_proj", "modulation", "RMSNorm", "QwenImage21Pipeline"} <= names
    text = '''"""A module naming RMSNorm and QwenImagePipeline in its docstring: allowed."""
for block in model.transformer_blocks:
    block.attn.to_add_out = None
NAMES = ("img_mod", "txt_mod.1")
help = "--model-class-name QwenImagePipeline"
flag = getattr(pipeline, "supports_dense_forward", True)
ok = getattr(args, "model_class_name", None)
'''
    assert sorted(name_uses("m", text, names)) == [
        "m:2 transformer_blocks",
        "m:3 to_add_out",
        "m:4 img_mod",
        "m:4 txt_mod",
        "m:5 QwenImagePipeline",
    ]
    assert probes("m", text) == ['m:6 getattr(pipeline, "supports_dense_forward", True)']


def test_no_model_names_outside_the_families():
    """LoRA, tensor parallelism, batch-invariant mode, FP8 and the runner read the family's plans
    (`models/plans.py`); the CLI and HTTP name pipelines through the registry."""
    assert model_name_uses() == []


def test_no_getattr_probes_of_model_objects_outside_the_families():
    """Capabilities are declared (`models/interface.py`), not probed."""
    assert model_probes() == []
