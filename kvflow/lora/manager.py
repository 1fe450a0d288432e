"""The model runner's LoRA adapters: which layers are adapted, the loaded adapters, and which
adapter sits in which device slot this step.

Adapters are loaded (read and checked) when they are added (``add_lora``: the engine calls it
before a request may use the adapter, so a bad folder fails there, never in a step) and kept in
host memory, at most ``max_cpu_loras`` of them (vLLM's LRU): past that the least recently used
one that no request of this runner holds is dropped, and read again from its folder when a
request asks for it (the folder as it is then). Every tensor-parallel rank and pipeline stage
sees the same adds and steps, so all drop and read the same adapters. Each step the adapters of the batch's rows are put into the
``max_loras`` device slots of every LoRA layer (an adapter already in a slot stays; a slot no
row uses is reused); the scheduler admits no request whose adapter would make a step use more
than ``max_loras`` adapters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from kvflow.config import LoRAConfig
from kvflow.layers.linear import LinearBase
from kvflow.lora.adapter import LoRAAdapter, load_adapter
from kvflow.lora.layers import (
    LoRAContext,
    LoRALinear,
    LoRAMapping,
    make_mapping,
    with_row_slots,
)
from kvflow.lora.request import LoRARequest

logger = logging.getLogger(__name__)


def wrap_lora_layers(model: nn.Module, max_loras: int, max_rank: int, ctx: LoRAContext
                     ) -> dict[str, LoRALinear]:
    """Replace each linear layer named in the model's ``supported_lora_modules`` by a
    :class:`LoRALinear` around it; returns them by module name.

    Raises:
        ValueError: when the model class declares no LoRA support.
    """
    supported = getattr(model, "supported_lora_modules", None)
    if not supported:
        raise ValueError(f"{type(model).__name__} does not support LoRA adapters in kvflow "
                         "(supported: the Llama family - Llama, Mistral, Qwen2, Qwen3, Phi-3 - Gemma 3 and the "
                         "MoE models Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3)")
    wrapped: dict[str, LoRALinear] = {}
    for name, module in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf in supported and isinstance(module, LinearBase):
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            layer = LoRALinear(module, max_loras, max_rank, ctx)
            setattr(parent, leaf, layer)
            wrapped[name] = layer
    return wrapped


def untargeted_parts(model: nn.Module, layers: dict[str, LoRALinear]) -> tuple[str, ...]:
    """A multimodal model's parts that hold no LoRA layer, as name prefixes (LLaVA's
    ``("vision_tower.", "multi_modal_projector.")``, Qwen2-VL's ``("visual.",)``): its vision
    tower and projector. ``()`` for a text model; the LM head is never one."""
    if not getattr(model, "supports_multimodal", False):
        return ()
    return tuple(f"{name}." for name, child in model.named_children()
                 if name != "lm_head" and any(True for _ in child.parameters())
                 and not any(layer.startswith(f"{name}.") for layer in layers))


class LoRAManager:
    """Adapters of one runner.

    Args:
        model: the loaded model (its layers are wrapped here).
        config: ``max_loras`` slots, ``max_lora_rank``.
        dtype: the model dtype.
        device: the model's device.
        model_type: the base model's config.json ``model_type`` (a config without
            ``target_modules`` adapts peft's default modules for it).
        elsewhere: module name -> whether another pipeline stage holds that layer (an
            adapter's weights for it are left to that stage); None with one stage.
        in_use: the adapters the runner's requests hold now, given request ids to leave
            out (finished ones the runner still has; never dropped from host memory:
            dropping one would free nothing and read it twice); None: none.

    Raises:
        ValueError: from the constructor for a model without LoRA support.
    """

    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype,
                 device: torch.device, model_type: str | None = None,
                 elsewhere: Callable[[str], bool] | None = None,
                 in_use: Callable[[frozenset[str]], Iterable[object]] | None = None
                 ) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        self.model_type = model_type
        # a context-parallel rank's share of a CPU step runs the kernel its row count picks
        self.ctx = LoRAContext(self.eager_cpu_kernel if device.type == "cpu" else None)
        self.layers = wrap_lora_layers(model, config.max_loras, config.max_lora_rank, self.ctx)
        self.targets = {name: layer.target for name, layer in self.layers.items()}
        self.packed: dict[str, tuple[str, Any]] = dict(getattr(model, "packed_modules_mapping",
                                                               {}))
        # the model's checkpoint renames (Qwen2-VL: model.language_model.* -> model.*)
        self.rename = getattr(model, "checkpoint_name", None)
        self.towers = untargeted_parts(model, self.layers)
        self.adapters: dict[int, LoRAAdapter] = {}  # host copies, least recently used first
        # adapters dropped for room (not removed): read again when a request asks for one
        self.evicted: dict[int, LoRARequest] = {}
        self.in_use = in_use or (lambda finished_ids=frozenset(): ())
        self.elsewhere = elsewhere
        self.slot_ids = [0] * config.max_loras  # lora_int_id held by each slot (0: none)
        # the adapter whose weights each slot holds (an id may stand for another folder later)
        self.slot_adapters: list[LoRAAdapter | None] = [None] * config.max_loras
        self._cpu_kernel: str | None = None  # resolved by cpu_kernel
        self._eager_kernels: dict[int, str] | None = None  # resolved by eager_cpu_kernel
        logger.info("LoRA: %d layers adapted, %d slots of rank %d", len(self.layers),
                    config.max_loras, config.max_lora_rank)

    def cpu_kernel(self, graphs: bool = True) -> str:
        """The CPU LoRA kernel of this engine, ``native`` or ``torch``
        (``KVFLOW_CPU_LORA``; under ``auto`` timed on this CPU for these layers' shapes,
        :func:`kvflow.lora.cpu_kernel_choice.resolve_cpu_lora`), resolved on the first call
        and kept. ``graphs``: whether ``native`` would let the decode steps replay.

        Raises:
            ValueError: when ``KVFLOW_CPU_LORA`` is not auto, native or torch.
        """
        if self._cpu_kernel is None:
            from kvflow.kernels.cpu_native import native_cpu_kernels
            from kvflow.lora.cpu_kernel_choice import resolve_cpu_lora

            self._cpu_kernel = resolve_cpu_lora(self.layers.values(), self.dtype,
                                                native_cpu_kernels(), graphs)
        return self._cpu_kernel

    def eager_cpu_kernel(self, rows: int) -> str:
        """The CPU LoRA kernel of an eager (not replayed) step of ``rows`` rows, ``native`` or
        ``torch`` (:func:`kvflow.lora.cpu_kernel_choice.resolve_eager_cpu_lora`, from the
        timings :meth:`cpu_kernel` reads), resolved on the first call and kept.

        Raises:
            ValueError: when ``KVFLOW_CPU_LORA`` is not auto, native or torch.
        """
        if self._eager_kernels is None:
            from kvflow.kernels.cpu_native import native_cpu_kernels
            from kvflow.lora.cpu_kernel_choice import resolve_eager_cpu_lora

            self._eager_kernels = resolve_eager_cpu_lora(self.layers.values(), self.dtype,
                                                         native_cpu_kernels())
        from kvflow.lora.cpu_kernel_choice import eager_kernel

        return eager_kernel(self._eager_kernels, rows)

    def add_lora(self, request: LoRARequest,
                 finished_ids: frozenset[str] = frozenset()) -> LoRAAdapter:
        """Load (read and check against the checkpoint's sizes) an adapter unless it is
        loaded, keeping this tensor-parallel rank's part of its weights, of this pipeline
        stage's layers; returns it. ``finished_ids``: requests finished since the last
        step, whose adapters are not held any more (the runner drops them at that step).

        Raises:
            ValueError: when the folder cannot be applied to this model (see
                :func:`kvflow.lora.adapter.load_adapter`).
        """
        adapter = self.adapters.get(request.lora_int_id)
        if adapter is None:
            adapter = self._load(request)
            self.evicted.pop(request.lora_int_id, None)
            self._keep(adapter, held=False, finished_ids=finished_ids)
        else:
            self.adapters[request.lora_int_id] = self.adapters.pop(request.lora_int_id)
        return adapter

    def request_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter a newly scheduled request runs with: the loaded one; one dropped for
        room (``max_cpu_loras``) read again from its folder and kept; or, when it was removed
        after the request was queued, a copy read again for that request alone. That copy is
        not kept here (it goes when its request does), so an unloaded adapter's weights do
        not stay in memory, nor come back for a later adapter given its id.

        Raises:
            ValueError: when the folder can no longer be applied (see :meth:`add_lora`).
        """
        lora_id = request.lora_int_id
        adapter = self.adapters.get(lora_id)
        if adapter is not None and adapter.request == request:
            self.adapters[lora_id] = self.adapters.pop(lora_id)  # most recently used
            return adapter
        if adapter is None and self.evicted.get(lora_id) == request:
            adapter = self._load(request)
            del self.evicted[lora_id]
            self._keep(adapter, held=True)
            return adapter
        return self._load(request)

    def _keep(self, adapter: LoRAAdapter, held: bool,
              finished_ids: frozenset[str] = frozenset()) -> None:
        """Keep ``adapter`` as the most recently used, then drop the least recently used
        ones no request holds (``held``: a request is about to hold ``adapter``; else it
        goes last, only when every other one is held) while more than ``max_cpu_loras``
        are kept."""
        lora_id = adapter.request.lora_int_id
        self.adapters[lora_id] = adapter
        excess = len(self.adapters) - self.config.cpu_loras
        if excess <= 0:
            return
        held_now = {id(a) for a in self.in_use(finished_ids)}
        free = [i for i, a in self.adapters.items() if i != lora_id and id(a) not in held_now]
        if not held:
            free.append(lora_id)
        for victim in free[:excess]:
            self._evict(victim)

    def _evict(self, lora_id: int) -> None:
        """Drop an adapter's host copy (and its slot: its weights are read again as a new
        copy), remembering its request so that a later one reads it again."""
        self.evicted[lora_id] = self.adapters.pop(lora_id).request
        self._free_slots(lora_id)
        logger.debug("LoRA: adapter %d dropped from host memory (max_cpu_loras=%d)", lora_id,
                     self.config.cpu_loras)

    def _load(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter, keeping this rank's and stage's part of its weights.

        Raises:
            ValueError: see :meth:`add_lora`.
        """
        adapter = load_adapter(request, self.targets, self.packed, self.config.max_lora_rank,
                               self.dtype, self.rename, self.model_type, self.elsewhere,
                               self.towers)
        adapter.weights = {name: self.layers[name].shard_weights(pairs)
                           for name, pairs in adapter.weights.items()}
        return adapter

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests already running with it keep their copy, put into a
        slot again at their next step); False if it was not loaded. Its slot is freed: the id
        may come back for another folder, whose weights must not be taken for those still in
        the slot."""
        self._free_slots(lora_int_id)
        evicted = self.evicted.pop(lora_int_id, None) is not None
        return self.adapters.pop(lora_int_id, None) is not None or evicted

    def _free_slots(self, lora_int_id: int) -> None:
        """Empty the slots holding ``lora_int_id``."""
        for slot, held in enumerate(self.slot_ids):
            if held == lora_int_id:
                self.slot_ids[slot], self.slot_adapters[slot] = 0, None

    def step_mapping(self, row_lora_ids: np.ndarray, token_rows: np.ndarray,
                     adapter_of: dict[int, LoRAAdapter]) -> LoRAMapping | None:
        """Put the step's adapters into slots and map its tokens to them.

        Args:
            row_lora_ids: int64 [num_rows] each batch row's adapter id (0: none).
            token_rows: int64 [T] the batch row of each token of the step.
            adapter_of: adapter id -> adapter, for every id in ``row_lora_ids``.

        Raises:
            ValueError: when the rows use more adapters than there are slots (the scheduler
                prevents it).
        """
        ids = [int(i) for i in np.unique(row_lora_ids) if i > 0]
        if not ids:
            return None
        if len(ids) > len(self.slot_ids):
            raise ValueError(f"a step uses {len(ids)} LoRA adapters; max_loras is "
                             f"{len(self.slot_ids)}")
        slot_of_id = self._activate(ids, adapter_of)
        row_slot = np.full(len(row_lora_ids), -1, np.int64)
        for lora_id, slot in slot_of_id.items():
            row_slot[row_lora_ids == lora_id] = slot
        mapping = make_mapping(row_slot[token_rows], self.device)
        if mapping is not None and self.device.type == "cpu" \
                and self.eager_cpu_kernel(len(token_rows)) == "native":
            # the native kernel's per-row slots (a step graph's steps put their own buffer's)
            mapping = with_row_slots(mapping)
        return mapping

    def _activate(self, ids: list[int], adapter_of: dict[int, LoRAAdapter]) -> dict[int, int]:
        """Slots holding ``ids``: those already there (the same adapter, not only the same
        id) stay, the others take slots no id of this step holds (their weights copied into
        every LoRA layer)."""
        for slot, held in enumerate(self.slot_ids):
            if held in adapter_of and self.slot_adapters[slot] is not adapter_of[held]:
                self.slot_ids[slot], self.slot_adapters[slot] = 0, None  # stale weights
        wanted = set(ids)
        free = [s for s, held in enumerate(self.slot_ids) if held not in wanted]
        for lora_id in ids:
            if lora_id in self.slot_ids:
                continue
            slot = free.pop(0)
            weights = adapter_of[lora_id].weights
            for name, layer in self.layers.items():
                layer.set_slot(slot, weights.get(name, {}))
            self.slot_ids[slot], self.slot_adapters[slot] = lora_id, adapter_of[lora_id]
        return {lora_id: self.slot_ids.index(lora_id) for lora_id in ids}
