"""`LoRAManager`: the adapters loaded into one transformer, by name, with per-request refcounts.

    start-up          add(name, path) for every --lora-modules entry
    request admitted  acquire(lora_request) -> lora_int_id   (refcount + 1; loads a runtime path first)
    every step        with manager.activate(mapping): transformer forward
    request ended     release(lora_int_id)                   (refcount - 1)
    runtime           add(...) / remove(name): remove refuses while any request holds the adapter

Ids are the engine's (1, 2, ...; never reused, 0 = no adapter); names are the client's handle. Each
loaded adapter also holds a *slot* (1 .. --max-loras, reused after an unload): its matrices live in
that slot of every linear it targets (layers.py), written in place. The members of a merged projection
(q, k, v of a stream) get their slots together, as one group, when an adapter first targets any of
them, and lose them together when none of them holds an adapter any more. A slot not held by an adapter is
empty on every linear, so a linear's slots need no clean-up when another adapter takes one.

NOTE(lora): loads and unloads write device memory that queued GPU work may still read. They run on the
same CUDA stream as the forwards, after the step lock: stream order makes earlier steps read the old
matrices and later ones the new.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vllm_omni.inputs import InvalidRequestError
from vllm_omni.lora.batch import LoRABatch, LoRAMapping
from vllm_omni.lora.config import LoRAConfig, resolve_runtime_path
from vllm_omni.lora.errors import LoRAInUseError, LoRANotFoundError
from vllm_omni.lora.layers import LoRAStepState, is_lora_linear, make_lora_slots, restore_linear
from vllm_omni.lora.request import LoRARequest, check_adapter_name
from vllm_omni.lora.weights import LoRAAdapter, LoRAFormatError, adapter_file, load_lora_adapter

logger = logging.getLogger(__name__)


@dataclass
class LoadedLoRA:
    """One loaded adapter."""

    name: str
    lora_int_id: int
    slot: int
    """Its slot in the linears' slot stacks (1 .. --max-loras)."""
    path: str
    """The PATH it was registered with (what `/v1/models` shows as `root`)."""
    file: str
    """The resolved adapter file it was read from."""
    rank: int
    module_names: tuple[str, ...]
    """The transformer linears it targets."""
    base_model_name: str | None = None
    """The `/v1/models` parent given with `--lora-modules` (None: the served model)."""
    num_users: int = 0
    """Admitted requests (waiting or running) that hold it."""


class LoRAManager:
    """Adapters of one transformer: loading, per-request refcounts and the per-step mapping."""

    def __init__(self, transformer: nn.Module, config: LoRAConfig):
        self.transformer = transformer
        self.config = config
        self.state = LoRAStepState()
        self._loaded: dict[str, LoadedLoRA] = {}
        self._by_id: dict[int, LoadedLoRA] = {}
        self._next_id = 1
        self._free_slots = list(range(config.max_loras, 0, -1))
        """Slots no adapter holds (the next one taken is the last)."""
        self._batch: tuple[LoRAMapping, LoRABatch] | None = None
        """The last forward's mapping and batch (a step of the same composition reuses it)."""
        self._lock = threading.RLock()
        """Guards the registry and refcounts (held briefly; requests are admitted under it)."""
        self._step_lock = threading.Lock()
        """Held for a whole forward; changing the modules' adapters waits for it (taken before _lock)."""
        self._modules = dict(transformer.named_modules())
        self.plan = transformer.plans.lora
        """The family's LoRA plan: the rows each linear sees (`row_stream`)."""
        if self.plan is None:
            raise ValueError(f"{type(transformer).__name__} declares no LoRA plan: it takes no LoRA adapters")
        for entry in config.lora_modules:
            self.add(entry.name, entry.path, entry.base_model_name)

    # ---- registry -------------------------------------------------------------------------

    def list_adapters(self) -> list[LoadedLoRA]:
        """Loaded adapters in load order."""
        with self._lock:
            return list(self._loaded.values())

    def add(self, name: str, path: str, base_model_name: str | None = None) -> int:
        """Load the adapter at `path` (trusted: an operator's path) as `name`; returns its id.

        ValueError when the name is taken, --max-loras is reached, or the file does not fit the model.
        """
        with self._lock:
            self._check_can_add(name)
        # read and checked outside the lock, on the host: nothing touches the device until the slots are
        # written under the step lock (a CUDA graph capture in the forward must see no other CUDA work)
        adapter = load_lora_adapter(path, self.transformer, self.config.max_lora_rank, device="cpu")
        return self.add_adapter(name, adapter, str(path), base_model_name)

    def add_adapter(
        self, name: str, adapter: LoRAAdapter, path: str, base_model_name: str | None = None
    ) -> int:
        """Install an already checked adapter (what `add` reads; benchmarks build one directly)."""
        with self._step_lock, self._lock:
            self._check_can_add(name)
            slot = self._free_slots.pop()
            entry = LoadedLoRA(
                name,
                self._next_id,
                slot,
                path,
                adapter.path,
                adapter.rank,
                tuple(adapter.modules),
                base_model_name,
            )
            self._next_id += 1
            max_loras, max_rank = self.config.max_loras, self.config.max_lora_rank
            for module_name, weights in adapter.modules.items():
                stream = self.plan.row_stream(module_name)
                slots = make_lora_slots(
                    self._modules, module_name, self.state, max_loras, max_rank, stream=stream
                )
                slots.write(slot, weights)
            self._loaded[name], self._by_id[entry.lora_int_id] = entry, entry
        logger.info(
            "LoRA adapter %r loaded from %s (rank %d, %d modules)",
            name,
            path,
            adapter.rank,
            len(adapter.modules),
        )
        return entry.lora_int_id

    def add_runtime(self, name: str, path: str, field_name: str = "lora_path") -> int:
        """`add` for a client-given path: only inside --lora-runtime-dir (ValueError naming `field_name`)."""
        return self.add(name, str(resolve_runtime_path(self.config.runtime_dir, path, field_name)))

    def _check_can_add(self, name: str) -> None:
        check_adapter_name(name, "lora_name")
        if name in self._loaded:
            raise ValueError(f"lora_name: an adapter named {name!r} is already loaded")
        if len(self._loaded) >= self.config.max_loras:
            raise ValueError(
                f"lora: {len(self._loaded)} adapters are loaded, the limit is --max-loras "
                f"{self.config.max_loras}"
            )

    def remove(self, name: str) -> None:
        """Unload `name`; LoRANotFoundError if unknown, LoRAInUseError while requests hold it."""
        with self._step_lock, self._lock:
            entry = self._loaded.get(name)
            if entry is None:
                raise LoRANotFoundError(f"lora_name: no adapter named {name!r} is loaded")
            if entry.num_users:
                raise LoRAInUseError(
                    f"lora_name: adapter {name!r} is in use by {entry.num_users} request(s); "
                    "retry when they finish"
                )
            for module_name in entry.module_names:
                module = self._modules[module_name]
                if is_lora_linear(module):  # (a merged group is freed with its last adapted member)
                    module.lora.clear(entry.slot)
                    if module.lora.can_free:
                        restore_linear(module)
            del self._loaded[name], self._by_id[entry.lora_int_id]
            self._free_slots.append(entry.slot)
            self._batch = None
        logger.info("LoRA adapter %r unloaded", name)

    # ---- requests -------------------------------------------------------------------------

    def _loaded_entry(self, name: str) -> LoadedLoRA:
        """The loaded adapter `name` (call holding `_lock`); LoRANotFoundError naming the loaded ones."""
        entry = self._loaded.get(name)
        if entry is None:
            names = sorted(self._loaded) or "none"
            raise LoRANotFoundError(f"lora.name: unknown adapter {name!r} (loaded: {names})")
        return entry

    def check(self, request: LoRARequest) -> None:
        """What `acquire` would refuse, without holding anything (request validation)."""
        if request.lora_path is not None:
            _request_path(self.config.runtime_dir, request.lora_path)
            return
        with self._lock:
            self._loaded_entry(request.lora_name)

    def acquire(self, request: LoRARequest) -> int:
        """Resolve the request's adapter (loading a runtime `lora_path` first) and hold it; its id.

        LoRANotFoundError for an unknown name; ValueError naming `lora` for a bad path or int_id.
        """
        if request.lora_path is not None:
            path = str(_request_path(self.config.runtime_dir, request.lora_path))
            with self._lock:
                known = self._loaded.get(request.lora_name)
            if known is None:
                self._add_for_request(request.lora_name, path)
            elif not _same_adapter(known.file, path):
                raise InvalidRequestError(
                    f"lora.path: adapter {request.lora_name!r} is already loaded from another path", "lora"
                )
        with self._lock:
            entry = self._loaded_entry(request.lora_name)
            if request.lora_int_id not in (0, entry.lora_int_id):
                raise InvalidRequestError(
                    f"lora.int_id {request.lora_int_id} is not adapter {request.lora_name!r}'s id "
                    f"({entry.lora_int_id}); omit it",
                    "lora",
                )
            entry.num_users += 1
            return entry.lora_int_id

    def _add_for_request(self, name: str, path: str) -> None:
        try:
            self.add(name, path)
        except ValueError as exc:
            with self._lock:
                if name in self._loaded:  # another request loaded it meanwhile
                    return
            raise InvalidRequestError(f"lora.path: {exc}", "lora") from exc

    def release(self, lora_int_id: int) -> None:
        """A request that held `lora_int_id` ended (finished, aborted or failed)."""
        with self._lock:
            entry = self._by_id.get(lora_int_id)
            if entry is not None and entry.num_users > 0:
                entry.num_users -= 1

    # ---- the step -------------------------------------------------------------------------

    def slot_of(self, lora_int_id: int) -> int:
        """The slot of loaded adapter `lora_int_id`; ValueError when it is not loaded."""
        with self._lock:
            entry = self._by_id.get(lora_int_id)
        if entry is None:
            raise ValueError(f"lora: adapter id {lora_int_id} is not loaded")
        return entry.slot

    def batch(self, mapping: LoRAMapping, device) -> LoRABatch:
        """The `LoRABatch` of `mapping` (the previous one when the mapping is unchanged)."""
        if self._batch is None or self._batch[0] != mapping:
            slots = {s.lora_int_id: self.slot_of(s.lora_int_id) for s in mapping.seqs if s.lora_int_id}
            self._batch = (mapping, LoRABatch.build(mapping, slots, device))
        return self._batch[1]

    @contextlib.contextmanager
    def activate(self, mapping: LoRAMapping | None, device=None):
        """Run the forward inside this block with `mapping`; loads / unloads wait for it to end.

        `device`: where the forward runs (default: the transformer's)."""
        with self._step_lock:
            batch = None
            if mapping is not None and mapping.has_adapters:
                batch = self.batch(mapping, device if device is not None else self._device())
            with self.state.activate(batch):
                yield

    def _device(self) -> torch.device:
        return next(self.transformer.parameters()).device


def _request_path(runtime_dir: str | None, path: str):
    """A request's `lora.path` resolved inside --lora-runtime-dir; InvalidRequestError naming `lora`."""
    try:
        return resolve_runtime_path(runtime_dir, path, "lora.path")
    except ValueError as exc:
        raise InvalidRequestError(str(exc), "lora") from None


def _same_adapter(loaded_file: str, path: str) -> bool:
    """Whether request path `path` names the adapter file already loaded (a path that holds no
    adapter names another one)."""
    try:
        return Path(loaded_file).resolve() == adapter_file(path).resolve()
    except LoRAFormatError:
        return False
