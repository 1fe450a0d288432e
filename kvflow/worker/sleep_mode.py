"""Sleep mode on one rank (vLLM's ``sleep`` / ``wake_up``, for RLHF loops that need the
accelerator's memory between rollouts).

```
sleep(level=1)  weights -> host memory (on a CPU device they stay: host memory is the device's)
                KV tensors freed (layers unbound; swap pool and step graphs dropped)
sleep(level=2)  weights dropped (the model object is let go), KV tensors freed
wake_up(tags)   "weights": offloaded weights back on the device (after level 2: nothing to
                restore; reload_weights builds the model again from its checkpoint)
                "kv_cache": the KV tensors allocated again, same KVCacheConfig (zeroed; while
                level 2's weights are gone, by reload_weights, for the new model's layers)
```
The step graphs (CUDA graphs, CPU step recordings) read the addresses of the weights and of
the KV tensors, so they are dropped at sleep and made again once both tags are awake.

What callers must guarantee (the engine core checks it): no request is running or waiting
(the KV tensors' contents are lost, and the scheduler's prefix cache is reset with them).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvflow.worker.step_graphs import make_graph_runner

logger = logging.getLogger(__name__)

WEIGHTS, KV_CACHE = "weights", "kv_cache"
SLEEP_TAGS = (WEIGHTS, KV_CACHE)


def check_sleep_level(level: Any) -> int:
    """``level`` as an int.

    Raises:
        ValueError: unless it is 1 (offload the weights, free the KV cache) or 2 (drop both).
    """
    if isinstance(level, bool) or level not in (1, 2):
        raise ValueError(f"sleep level={level!r} must be 1 (weights offloaded to host "
                         "memory, KV cache freed) or 2 (weights and KV cache dropped)")
    return int(level)


def check_wake_tags(tags: Any) -> tuple[str, ...]:
    """The tags to wake (None: all of ``SLEEP_TAGS``), in ``SLEEP_TAGS`` order.

    Raises:
        ValueError: for a tag other than "weights" and "kv_cache", or an empty list.
    """
    if tags is None:
        return SLEEP_TAGS
    if isinstance(tags, str) or not isinstance(tags, (list, tuple, set)) or not tags:
        raise ValueError(f"wake_up tags={tags!r} must be None or a non-empty list of "
                         f"{list(SLEEP_TAGS)}")
    unknown = [t for t in tags if t not in SLEEP_TAGS]
    if unknown:
        raise ValueError(f"wake_up tags: unknown {unknown}; valid: {list(SLEEP_TAGS)}")
    return tuple(t for t in SLEEP_TAGS if t in tags)


@dataclass
class MovedTensor:
    """One tensor moved off its device: where it lives (a module's parameter, buffer or
    plain attribute) and the device it came from."""

    module: nn.Module
    kind: str  # "param", "buffer" or "attr"
    name: str
    device: torch.device

    def get(self) -> torch.Tensor:
        if self.kind == "param":
            return self.module._parameters[self.name]
        if self.kind == "buffer":
            return self.module._buffers[self.name]
        return getattr(self.module, self.name)

    def put(self, tensor: torch.Tensor) -> None:
        """Replace the tensor; a parameter keeps its identity (its ``data`` changes)."""
        if self.kind == "param":
            self.module._parameters[self.name].data = tensor
        elif self.kind == "buffer":
            self.module._buffers[self.name] = tensor
        else:
            setattr(self.module, self.name, tensor)


def collect_tensors(models: list[nn.Module],
                    select: Callable[[torch.Tensor], bool]) -> list[MovedTensor]:
    """Every tensor of ``models`` that ``select`` picks: parameters, buffers and tensors kept
    as plain module attributes (packed or quantized copies, RoPE tables), each object once (a
    tied weight is one parameter); the KV tensors bound to attention layers are left out."""
    return collect_module_tensors([m for model in models for m in model.modules()], select)


def collect_module_tensors(modules: Iterable[nn.Module],
                           select: Callable[[torch.Tensor], bool]) -> list[MovedTensor]:
    """:func:`collect_tensors` over the given modules only (not their children), in their
    order: a tensor several of them hold is named by the first."""
    found, seen = [], set()
    for module in modules:
        tensors = [("param", n, p) for n, p in module._parameters.items()] + \
            [("buffer", n, b) for n, b in module._buffers.items()] + \
            [("attr", n, v) for n, v in vars(module).items()
             if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)
             and n not in ("kv_cache", "kv_scales")]
        for kind, name, t in tensors:
            if t is not None and id(t) not in seen and select(t):
                seen.add(id(t))
                found.append(MovedTensor(module, kind, name, t.device))
    return found


def _copy_storage(storage: torch.UntypedStorage, target: torch.device) -> torch.UntypedStorage:
    """A copy of ``storage``'s bytes on ``target`` (pinned when a GPU's go to the host)."""
    raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,))
    copy = raw.to(target, copy=True)
    if target.type == "cpu" and storage.device.type == "cuda":
        copy = copy.pin_memory()  # a faster copy back at wake-up
    return copy.untyped_storage()


def relocate(moved: list[MovedTensor], target: torch.device | None) -> None:
    """Copy the tensors ``moved`` lists to ``target`` (None: back to the device each came
    from) and put the copies in their places. Storage by storage: tensors that shared one
    (a view of a weight kept as an attribute, a tied weight) share its copy, at the same
    offsets and strides, so the aliasing a weight update relies on survives."""
    copies: dict[tuple[str, int], torch.UntypedStorage] = {}
    for m in moved:
        t = m.get()
        storage = t.untyped_storage()
        key = (str(storage.device), storage.data_ptr())
        device = target or m.device
        if key not in copies:
            copies[key] = _copy_storage(storage, device)
        m.put(torch.empty(0, dtype=t.dtype, device=device).set_(
            copies[key], t.storage_offset(), t.size(), t.stride()))


def offload_weights(models: list[nn.Module], host: torch.device) -> list[MovedTensor]:
    """Move every tensor of ``models`` (:func:`collect_tensors`) not on ``host`` there;
    returns what moved, for :func:`restore_weights`."""
    moved = collect_tensors(models, lambda t: t.device != host)
    relocate(moved, host)
    return moved


def restore_weights(moved: list[MovedTensor]) -> None:
    """Put back on their devices the tensors :func:`offload_weights` moved."""
    relocate(moved, None)


def kv_tensor_bytes(runner) -> int:
    """Bytes of the KV tensors the runner holds (its list and the tensors bound to its
    layers, each storage counted once): 0 while its KV cache sleeps."""
    layers = list(runner.attn_layers.values()) + \
        (list(runner.drafter.attn_layers.values()) if runner.drafter is not None else [])
    tensors = list(runner.kv_caches) + [t for layer in layers
                                        for t in (layer.kv_cache, layer.kv_scales)
                                        if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@dataclass
class RunnerSleep:
    """One runner's sleep state: which tags sleep, what level 1 offloaded, whether level 2
    dropped the weights (and the LoRA adapters to load into the rebuilt model), and the graph
    runner's ``max_model_len`` to make it again."""

    asleep: set[str] = field(default_factory=set)
    offloaded: list[MovedTensor] = field(default_factory=list)
    weights_dropped: bool = False
    adapters: dict[int, Any] = field(default_factory=dict)  # LoRA adapters of dropped weights
    evicted: dict[int, Any] = field(default_factory=dict)  # and those max_cpu_loras dropped
    graphs_len: int | None = None  # capture_graphs' max_model_len (None: never captured)

    def sleep(self, runner, level: int) -> None:
        """Put ``runner`` to sleep at ``level`` (see the module docstring); a no-op if it
        sleeps already."""
        level = check_sleep_level(level)
        if self.asleep:
            logger.warning("sleep(level=%d): this rank is asleep already", level)
            return
        runner.graph_runner = None
        _free_kv_cache(runner)
        if runner.mm_runner is not None:  # the engine core's mirror forgets them too
            runner.mm_runner.encoder_cache.clear()
        if level == 2:
            if not self.weights_dropped:  # else dropped already, adapters kept aside
                self.adapters, self.evicted = _lora_adapters(runner)
            _drop_model(runner)
            self.weights_dropped = True
        elif runner.device.type != "cpu" and not self.weights_dropped:  # dropped: none left
            self.offloaded = offload_weights(_models(runner), torch.device("cpu"))
        self.asleep = set(SLEEP_TAGS)
        gc.collect()
        runner.platform.empty_cache()

    def wake_up(self, runner, tags: tuple[str, ...]) -> None:
        """Wake the ``tags`` (checked by :func:`check_wake_tags`) that sleep; the others are
        left as they are."""
        if WEIGHTS in tags and WEIGHTS in self.asleep:
            restore_weights(self.offloaded)
            self.offloaded = []
            self.asleep.discard(WEIGHTS)
        if KV_CACHE in tags and KV_CACHE in self.asleep:
            self.asleep.discard(KV_CACHE)
            if not self.weights_dropped:  # else reload_weights allocates them for its layers
                _allocate_kv_cache(runner)
        self._remake_graphs(runner)

    def reload_weights(self, runner) -> None:
        """Build the model again from its checkpoint (the draft model too), keeping the KV
        tensors bound (when awake) and the LoRA adapters loaded.

        The old model is let go first (two would not fit): a load that fails leaves the
        runner as a level-2 sleep does (weights dropped, adapters kept aside, no step
        graphs), for another ``reload_weights``.

        Raises:
            ValueError: while the weights sleep (``wake_up(tags=["weights"])`` first), or
                from loading the checkpoint.
        """
        if WEIGHTS in self.asleep:
            raise ValueError("reload_weights: the weights are asleep; call "
                             "wake_up(tags=['weights']) first")
        bindings = _kv_bindings(runner)
        if not self.weights_dropped:
            self.adapters, self.evicted = _lora_adapters(runner)
        adapters, evicted = self.adapters, self.evicted
        _drop_model(runner)
        self.weights_dropped = True  # until the load below succeeds
        gc.collect()
        runner.platform.empty_cache()
        runner.load_model()
        for layers in _layer_maps(runner):
            for name, layer in layers.items():
                if name in bindings:
                    layer.kv_cache, layer.kv_group, layer.kv_scales = bindings[name]
        if not bindings and KV_CACHE not in self.asleep:  # woken while the weights were gone
            _free_kv_cache(runner)  # unbound tensors a failed reload left
            _allocate_kv_cache(runner)
        if runner.lora_manager is not None:
            runner.lora_manager.adapters.update(adapters)
            runner.lora_manager.evicted.update(evicted)
        self.weights_dropped, self.adapters, self.evicted = False, {}, {}
        self._remake_graphs(runner)

    def _remake_graphs(self, runner) -> None:
        if not self.asleep and not self.weights_dropped and self.graphs_len is not None \
                and runner.graph_runner is None:
            runner.graph_runner = make_graph_runner(runner, self.graphs_len)


def _models(runner) -> list[nn.Module]:
    return [runner.model] + ([runner.drafter.model] if runner.drafter is not None else [])


def _lora_adapters(runner) -> tuple[dict[int, Any], dict[int, Any]]:
    """The runner's loaded LoRA adapters (lora_int_id -> adapter; read from their folders,
    independent of the model object) and those ``max_cpu_loras`` dropped (lora_int_id ->
    LoRARequest, read again when asked for)."""
    manager = runner.lora_manager
    return ({}, {}) if manager is None else (dict(manager.adapters), dict(manager.evicted))


def _layer_maps(runner) -> list[dict[str, nn.Module]]:
    return [runner.attn_layers] + \
        ([runner.drafter.attn_layers] if runner.drafter is not None else [])


def _kv_bindings(runner) -> dict[str, tuple[torch.Tensor, int, torch.Tensor | None]]:
    """Layer name -> (kv_cache, kv_group, kv_scales) of every attention layer (target and
    draft) that has a KV tensor bound."""
    return {name: (layer.kv_cache, layer.kv_group, getattr(layer, "kv_scales", None))
            for layers in _layer_maps(runner) for name, layer in layers.items()
            if layer.kv_cache.numel()}


def _allocate_kv_cache(runner) -> None:
    if runner.kv_cache_config is not None:
        runner.allocate_kv_tensors(runner.kv_cache_config)


def _free_kv_cache(runner) -> None:
    """Unbind and drop every KV tensor of ``runner`` (the swap pool's host copy too)."""
    runner.release_kv_tensors()
    runner.host_kv = None


def _drop_model(runner) -> None:
    """Let go of every reference the runner holds to its model's weights (target, draft,
    LoRA layers, pooling head, step graphs)."""
    runner.graph_runner = None
    runner.model = None
    runner.attn_layers = {}
    runner.lora_manager = runner.pooling = runner.mm_runner = runner.embed_prompts = None
    runner.drafter = None
    runner.weight_bytes = 0

