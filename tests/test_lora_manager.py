"""LoRAManager and adapter files: format checks, limits, path confinement, refcounted unload, flags."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from safetensors.torch import save_file
from utils import TINY

from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer, QwenImageTransformerConfig
from vllm_omni.inputs import InvalidRequestError
from vllm_omni.lora import LoRAConfig, LoRAModulePath, LoRARequest
from vllm_omni.lora.layers import is_lora_linear
from vllm_omni.lora.manager import LoRAInUseError, LoRAManager, LoRANotFoundError
from vllm_omni.lora.random_adapter import random_lora_adapter, random_lora_state_dict, save_lora_dir
from vllm_omni.lora.weights import LoRAFormatError, load_lora_adapter

Q = "transformer_blocks.0.attn.to_q"


@pytest.fixture
def model():
    return QwenImageTransformer(QwenImageTransformerConfig.from_dict(TINY)).eval()


def _adapter(model, directory, rank=2, targets=(Q,), **kw):
    return str(save_lora_dir(directory, random_lora_state_dict(model, list(targets), rank, seed=0, **kw)))


def test_directory_and_file_paths_load(model, tmp_path):
    directory = _adapter(model, tmp_path / "a")
    by_dir = load_lora_adapter(directory, model, max_rank=8)
    by_file = load_lora_adapter(os.path.join(directory, "pytorch_lora_weights.safetensors"), model, 8)
    assert by_dir.path == by_file.path and set(by_dir.modules) == {Q} and by_dir.rank == 2
    assert by_dir.modules[Q].scaling == 1.0  # no alpha: peft's alpha = rank


def test_alpha_sets_scaling(model, tmp_path):
    adapter = load_lora_adapter(_adapter(model, tmp_path / "a", rank=4, alpha=2.0), model, 8)
    assert adapter.modules[Q].scaling == 0.5


def _ab(a_shape, b_shape, module=Q):
    key = f"transformer.{module}"
    return {f"{key}.lora_A.weight": torch.zeros(a_shape), f"{key}.lora_B.weight": torch.zeros(b_shape)}


@pytest.mark.parametrize(
    "state, match",
    [
        ({f"transformer.{Q}.lora_A.weight": torch.zeros(2, 32)}, "has no lora_B"),
        (_ab((2, 32), (32, 2), module="nope"), "not a linear"),
        (_ab((2, 31), (32, 2)), r"lora_A.weight is \[2, 31\]"),
        (_ab((2, 32), (32, 3)), r"lora_B.weight is \[32, 3\]"),
        (_ab((9, 32), (32, 9)), "rank 9 > --max-lora-rank 8"),
        ({f"transformer.{Q}.weight": torch.zeros(2, 32)}, "not a lora_A / lora_B weight"),
    ],
)
def test_bad_files_name_the_file_and_key(model, tmp_path, state, match):
    file = tmp_path / "bad.safetensors"
    save_file(state, str(file))
    with pytest.raises(LoRAFormatError, match=match) as info:
        load_lora_adapter(file, model, max_rank=8)
    assert str(file) in str(info.value)


def test_missing_and_non_safetensors_paths(model, tmp_path):
    with pytest.raises(LoRAFormatError, match="no pytorch_lora_weights.safetensors"):
        load_lora_adapter(tmp_path, model, 8)
    (tmp_path / "x.bin").write_bytes(b"123")
    with pytest.raises(LoRAFormatError, match="a .safetensors file or a directory"):
        load_lora_adapter(tmp_path / "x.bin", model, 8)
    (tmp_path / "x.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoRAFormatError, match="not a readable safetensors file"):
        load_lora_adapter(tmp_path / "x.safetensors", model, 8)


def test_max_loras_and_duplicate_names(model, tmp_path):
    manager = LoRAManager(model, LoRAConfig(enabled=True, max_loras=2))
    path = _adapter(model, tmp_path / "a")
    assert (manager.add("a", path), manager.add("b", path)) == (1, 2)
    with pytest.raises(ValueError, match="limit is --max-loras 2"):
        manager.add("c", path)
    manager.remove("b")
    with pytest.raises(ValueError, match="already loaded"):
        manager.add("a", path)
    assert manager.add("c", path) == 3  # ids are never reused
    assert [e.name for e in manager.list_adapters()] == ["a", "c"]


def test_unknown_name_and_int_id_mismatch(model, tmp_path):
    manager = LoRAManager(
        model, LoRAConfig(lora_modules=(LoRAModulePath("a", _adapter(model, tmp_path / "a")),))
    )
    with pytest.raises(LoRANotFoundError, match=r"lora.name: unknown adapter 'zzz' \(loaded: \['a'\]\)"):
        manager.acquire(LoRARequest("zzz"))
    with pytest.raises(ValueError, match="lora.int_id 5 is not adapter 'a'"):
        manager.acquire(LoRARequest("a", 5))
    assert manager.acquire(LoRARequest("a", 1)) == 1


def test_adapter_in_use_is_never_unloaded(model, tmp_path):
    manager = LoRAManager(model, LoRAConfig(enabled=True))
    lora_id = manager.add("a", _adapter(model, tmp_path / "a"))
    q = dict(model.named_modules())[Q]
    assert is_lora_linear(q)
    assert manager.acquire(LoRARequest("a")) == manager.acquire(LoRARequest("a")) == lora_id
    manager.release(lora_id)
    with pytest.raises(LoRAInUseError, match="in use by 1 request"):
        manager.remove("a")
    manager.release(lora_id)
    manager.remove("a")
    assert not is_lora_linear(q) and q.lora is None and q.runs_plain_gemm(torch.zeros(1, q.in_features))
    # (a plain GEMM again: the fused QKV applies again)
    with pytest.raises(LoRANotFoundError):
        manager.remove("a")


def test_request_paths_stay_inside_the_runtime_dir(model, tmp_path):
    root, outside = tmp_path / "loras", tmp_path / "elsewhere"
    _adapter(model, root / "ok")
    _adapter(model, outside)
    (root / "link").symlink_to(outside, target_is_directory=True)
    closed = LoRAManager(model, LoRAConfig(enabled=True))
    with pytest.raises(ValueError, match="loading adapters from a path is disabled"):
        closed.acquire(LoRARequest("x", lora_path=str(root / "ok")))
    manager = LoRAManager(model, LoRAConfig(runtime_dir=str(root)))
    for bad in ("../elsewhere", str(outside), "link", "ok/../../elsewhere"):
        with pytest.raises(ValueError, match="must lie inside the server's LoRA directory"):
            manager.acquire(LoRARequest("x", lora_path=bad))
    with pytest.raises(ValueError, match="does not exist"):
        manager.acquire(LoRARequest("x", lora_path="missing"))
    assert manager.acquire(LoRARequest("x", lora_path="ok")) == 1  # relative to the directory: loads
    assert manager.acquire(LoRARequest("x", lora_path=str(root / "ok"))) == 1  # same adapter
    (root / "bad.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="lora.path: .*not a readable safetensors file"):
        manager.acquire(LoRARequest("y", lora_path="bad.safetensors"))
    _adapter(model, root / "other")
    with pytest.raises(ValueError, match="already loaded from another path"):
        manager.acquire(LoRARequest("x", lora_path="other"))
    # found by fuzzing: these were a 500 (ENAMETOOLONG) and a message echoing the server's path
    for too_long in ("a" * 300, "ok/" + "a" * 300):
        with pytest.raises(ValueError, match=r"lora.path '.*' \(30\d characters\) is not a usable path"):
            manager.acquire(LoRARequest("z", lora_path=too_long))
    with pytest.raises(InvalidRequestError, match="already loaded from another path") as refused:
        manager.acquire(LoRARequest("x", lora_path="."))  # the directory itself holds no adapter file
    assert refused.value.param == "lora" and str(root) not in str(refused.value)


def test_lora_modules_flag_forms(tmp_path):
    assert LoRAModulePath.parse("a=/p/a") == LoRAModulePath("a", "/p/a")
    parsed = LoRAModulePath.parse('{"name": "b", "path": "/p/b", "base_model_name": "m"}')
    assert parsed == LoRAModulePath("b", "/p/b", "m")
    for bad, match in (
        ("noequals", "NAME=PATH"),
        ("{bad json", "invalid JSON"),
        ('{"name": "a"}', "non-empty"),
        ('{"x": 1}', "JSON entries"),
    ):
        with pytest.raises(ValueError, match=match):
            LoRAModulePath.parse(bad)
    with pytest.raises(ValueError, match="unique"):
        LoRAConfig(lora_modules=(LoRAModulePath("a", "x"), LoRAModulePath("a", "y")))
    with pytest.raises(ValueError, match="--max-lora-rank must be an integer"):
        LoRAConfig(max_lora_rank=0)
    with pytest.raises(ValueError, match="--lora-runtime-dir"):
        LoRAConfig(runtime_dir=str(tmp_path / "missing"))
    assert not LoRAConfig().is_enabled and LoRAConfig(runtime_dir=str(tmp_path)).is_enabled


def test_admission_does_not_wait_for_a_running_forward(model, tmp_path):
    manager = LoRAManager(model, LoRAConfig(enabled=True))
    manager.add("a", _adapter(model, tmp_path / "a"))
    got = []
    with manager.activate(None):  # a forward in flight on this thread
        thread = threading.Thread(target=lambda: got.append(manager.acquire(LoRARequest("a"))))
        thread.start()
        thread.join(timeout=10)
    assert got == [1]


def test_lora_with_parallel_flags_is_refused():
    from vllm_omni.config import OmniDiffusionConfig, ParallelConfig

    with pytest.raises(ValueError, match="LoRA adapters run on one device"):
        OmniDiffusionConfig(
            lora=LoRAConfig(enabled=True), parallel_config=ParallelConfig(tensor_parallel_size=2)
        )


def test_lora_flags_found_by_fuzzing_the_cli(model, tmp_path):
    """A repeated --lora-modules adds to the first (it replaced it), --lora-runtime-dir '' is refused
    (it meant the current directory), and a --lora-modules path without an adapter is a one-line
    start-up error (it was a traceback after the model loaded)."""
    import argparse

    from vllm_omni.config import OmniDiffusionConfig
    from vllm_omni.entrypoints.cli.lora_args import add_lora_arguments, lora_config_from_args
    from vllm_omni.entrypoints.cli.startup_checks import check_lora_modules

    parser = argparse.ArgumentParser()
    add_lora_arguments(parser)
    args = parser.parse_args(["--lora-modules", "a=/x", "--lora-modules", "b=/y", "c=/z"])
    assert [m.name for m in lora_config_from_args(args).lora_modules] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="--lora-runtime-dir '' is not a directory"):
        LoRAConfig(runtime_dir="")
    good = _adapter(model, tmp_path / "good")
    (tmp_path / "notes.txt").write_text("x")
    for path, ok in ((good, True), (str(tmp_path / "missing"), False), (str(tmp_path / "notes.txt"), False)):
        config = OmniDiffusionConfig(lora=LoRAConfig(lora_modules=(LoRAModulePath("a", path),)))
        message = check_lora_modules(config)
        assert (message is None) == ok, message
        assert ok or message.startswith(f"--lora-modules a={path}: ")


def test_unload_then_load_rewrites_the_freed_slot_in_place(model, tmp_path):
    """Adapters take slots; an unload empties its slot on every linear it targets and a later load
    takes the freed slot, writing the same tensors (what a captured CUDA graph keeps reading). Only
    a linear gaining or losing its slots bumps the version (graphs with LoRA are captured again)."""
    manager = LoRAManager(model, LoRAConfig(enabled=True, max_loras=2, max_lora_rank=4))
    path = _adapter(model, tmp_path / "a")
    a, b = manager.add("a", path), manager.add("b", path)
    assert (manager.slot_of(a), manager.slot_of(b)) == (1, 2)
    slots = dict(model.named_modules())[Q].lora
    ptrs, version = (
        (slots.lora_a.data_ptr(), slots.lora_b.data_ptr(), slots.scaling.data_ptr()),
        manager.state.version,
    )
    manager.remove("b")
    assert slots.scaling_cpu == [0.0, 1.0, 0.0] and not slots.lora_a[1].any()
    c = manager.add("c", _adapter(model, tmp_path / "c", rank=3))
    assert manager.slot_of(c) == 2 and slots.ranks[2] == 3 and slots.scaling_cpu[2] == 1.0
    assert (slots.lora_a.data_ptr(), slots.lora_b.data_ptr(), slots.scaling.data_ptr()) == ptrs
    assert manager.state.version == version
    with pytest.raises(ValueError, match="adapter id 2 is not loaded"):
        manager.slot_of(b)
    manager.remove("a")
    manager.remove("c")
    assert dict(model.named_modules())[Q].lora is None and manager.state.version == version + 1


def test_a_merged_projection_gets_and_frees_its_slots_as_one_group(model):
    """q, k, v of a stream share one slot group (one shrink, one expand on CUDA): an adapter on q alone
    gives k and v empty slots too; the group is freed only when none of them holds an adapter."""
    manager = LoRAManager(model, LoRAConfig(enabled=True, max_loras=2, max_lora_rank=4))
    modules = dict(model.named_modules())
    attn = "transformer_blocks.0.attn"
    q, k, v = (modules[f"{attn}.{n}"] for n in ("to_q", "to_k", "to_v"))
    version = manager.state.version
    manager.add_adapter("a", random_lora_adapter(model, [Q], 2, seed=1), "<random>")
    manager.add_adapter("b", random_lora_adapter(model, [f"{attn}.to_v"], 3, seed=2), "<random>")
    group = q.lora.group
    assert group is not None and group.members == (q, k, v) and k.lora.group is v.lora.group is group
    assert manager.state.version == version + 1  # one new set of slots: the group
    assert k.lora.is_empty and v.lora.scaling_cpu == [0.0, 0.0, 1.0] and q.lora.scaling_cpu == [0.0, 1.0, 0.0]
    assert float(group.scaling[2, 2]) == 1.0 and not group.lora_a[1, :32].any()  # slot 2: v only (rows 32:48)
    assert v.lora.lora_a.data_ptr() == group.lora_a[:, 2 * 16 :].data_ptr()  # a view of the stacks
    assert modules[f"{attn}.add_q_proj"].lora is None  # the text stream's group: not targeted
    manager.remove("a")
    assert q.lora is not None and q.lora.is_empty and manager.state.version == version + 1  # v holds b
    manager.remove("b")
    assert q.lora is None and k.lora is None and v.lora is None and manager.state.version == version + 2
