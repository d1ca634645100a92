"""Which LoRA adapters are loaded, under which names, and which keep their weights in host memory.

An adapter gets a lora_id (an int never reused in the process; 0 is the base model) when it is
loaded; requests, the prefix-cache salt and the device slots (core/lora/slots.py) know it by that
id, so an adapter removed and loaded again under the same name never shares a slot's weights or a
cached KV block with its former self.

Threads: add / remove / list may be called from any thread (AsyncLLMEngine runs `add` on the
engine thread, where its torch ops belong); everything else runs on the engine thread. One lock
guards the maps.

Removal: a removed adapter takes no new requests (UnknownLoRAAdapter), but the requests already
accepted on it run to their end; its host weights go once the last of them has ended (its device
slot is simply never asked for again, and LRU hands it to the next adapter).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from pagedserve.core.config import LoRAConfig
from pagedserve.core.errors import InvalidLoRAAdapter, UnknownLoRAAdapter
from pagedserve.core.lora.peft import LoRAWeights, load_peft_adapter
from pagedserve.core.models.arch import ModelArch


@dataclass(frozen=True)
class LoRAStats:
    """Adapters of the running and waiting requests (distinct names, sorted) and max_loras: what
    vLLM's vllm:lora_requests_info gauge reports."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_lora: int


@dataclass(eq=False)
class _Adapter:
    lora_id: int
    name: str
    path: str
    weights: LoRAWeights | None
    """None once dropped from host memory (beyond max_cpu_loras): read again from `path` when needed."""
    refs: int = 0
    """Live requests on this adapter."""
    removed: bool = False


class LoRAManager:
    def __init__(self, config: LoRAConfig, arch: ModelArch, dtype: torch.dtype) -> None:
        self.config = config
        self.arch, self.dtype = arch, dtype
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras
        self._lock = threading.Lock()
        self._by_name: dict[str, _Adapter] = {}
        self._by_id: dict[int, _Adapter] = {}
        """Every adapter a request may still use: the loaded ones, and removed ones with live requests."""
        self._in_memory: OrderedDict[int, None] = OrderedDict()
        """lora_ids whose weights are on the host, least recently used first."""
        self._next_id = 1

    # -- any thread ------------------------------------------------------------------------------
    def add(self, name: str, path: str) -> None:
        """Load and register an adapter; the same name and path again is a no-op."""
        if not isinstance(name, str) or not name:
            raise InvalidLoRAAdapter(f"lora_name={name!r}: give the adapter a non-empty name", param="lora_name")
        if not isinstance(path, str) or not path:
            raise InvalidLoRAAdapter(f"lora_path={path!r}: give the adapter's PEFT directory", param="lora_path")
        with self._lock:
            known = self._by_name.get(name)
            if known is not None:
                if os.path.realpath(known.path) == os.path.realpath(path):
                    return
                raise InvalidLoRAAdapter(f"a LoRA adapter named {name!r} is already loaded from {known.path}; "
                                         "remove it first or load this one under another name", param="lora_name")
        weights = load_peft_adapter(path, self.arch, self.dtype, self.config.max_lora_rank)
        with self._lock:
            if name in self._by_name:  # loaded meanwhile by another caller
                return
            adapter = _Adapter(self._next_id, name, path, weights)
            self._next_id += 1
            self._by_name[name] = self._by_id[adapter.lora_id] = adapter
            self._remember(adapter)

    def remove(self, name: str) -> bool:
        """Unregister an adapter (False if none has that name); its running requests finish."""
        with self._lock:
            adapter = self._by_name.pop(name, None)
            if adapter is None:
                return False
            adapter.removed = True
            self._maybe_forget(adapter)
            return True

    def list(self) -> dict[str, str]:
        with self._lock:
            return {name: a.path for name, a in self._by_name.items()}

    # -- engine thread ---------------------------------------------------------------------------
    def acquire(self, name: str) -> int:
        """The adapter's lora_id for a new request, counted until release(); UnknownLoRAAdapter if none."""
        with self._lock:
            adapter = self._by_name.get(name) if isinstance(name, str) else None
            if adapter is None:
                loaded = ", ".join(sorted(self._by_name)) or "none"
                raise UnknownLoRAAdapter(f"LoRA adapter {name!r} is not loaded (loaded: {loaded}); load it first "
                                         "or name a loaded one", param="lora_name")
            adapter.refs += 1
            return adapter.lora_id

    def release(self, lora_id: int) -> None:
        if lora_id == 0:
            return
        with self._lock:
            adapter = self._by_id[lora_id]
            adapter.refs -= 1
            self._maybe_forget(adapter)

    def name_of(self, lora_id: int) -> str:
        with self._lock:
            return self._by_id[lora_id].name

    def weights(self, lora_id: int) -> LoRAWeights:
        """The adapter's host weights (read from its directory again if they were dropped)."""
        with self._lock:
            adapter = self._by_id[lora_id]
            weights = adapter.weights
        if weights is None:
            weights = load_peft_adapter(adapter.path, self.arch, self.dtype, self.config.max_lora_rank)
        with self._lock:
            adapter.weights = weights
            self._remember(adapter)
        return weights

    # -- under the lock --------------------------------------------------------------------------
    def _remember(self, adapter: _Adapter) -> None:
        """Mark the adapter's weights most recently used; drop the least recently used beyond max_cpu_loras."""
        self._in_memory[adapter.lora_id] = None
        self._in_memory.move_to_end(adapter.lora_id)
        while len(self._in_memory) > self.max_cpu_loras:
            old, _ = self._in_memory.popitem(last=False)
            if old in self._by_id:
                self._by_id[old].weights = None

    def _maybe_forget(self, adapter: _Adapter) -> None:
        if adapter.removed and adapter.refs == 0 and adapter.lora_id in self._by_id:
            del self._by_id[adapter.lora_id]
            self._in_memory.pop(adapter.lora_id, None)


def lora_stats(manager: LoRAManager | None, running: list, waiting: object, max_loras: int) -> LoRAStats:
    """LoRAStats of the scheduler's running and waiting samples (engine thread)."""
    if manager is None:
        return LoRAStats((), (), 0)

    def names(requests) -> tuple[str, ...]:
        return tuple(sorted({manager.name_of(r.lora_id) for r in requests if r.lora_id}))

    return LoRAStats(names(running), names(waiting), max_loras)
