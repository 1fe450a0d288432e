"""A CPU model's streamed weights moved onto transparent huge pages after loading.

kvflow's packed GEMM weights are packed straight into a :class:`HugePageArena`
(``cpu_setup.choose_gemm_path``). The weights that other kernels multiply as loaded (INT8 /
INT4 / FP8 weight-only layers, GGUF blocks kept quantized, MoE experts, and every GEMM under
``KVFLOW_NATIVE_CPU=0`` or oneDNN's fallback) stay torch allocations of their own, on 4 KB
pages for the many under 2 MB: a decode step streams them all once, and on 4 KB pages the
hardware prefetchers stop at every page boundary (docs/benchmarks.md, "session 39: packed
weights on huge pages": INT8 SmolLM2-135M decode at batch 1, one thread, 1.15-1.3x by CPU
time). :func:`place_weights_on_huge_pages` copies each such tensor into the arena and puts
the copy in its place. Embedding tables (looked up by rows, not streamed) stay where they are.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvflow.platforms.cpu_memory import HugePageArena
from kvflow.worker.cpu_step_record import held_tensors
from kvflow.worker.sleep_mode import MovedTensor, collect_module_tensors

MIN_BYTES = 64 << 10  # smaller tensors (norms, biases, scales) are not worth a copy


def place_weights_on_huge_pages(model: nn.Module, arena: HugePageArena,
                                min_bytes: int | None = None) -> int:
    """Move ``model``'s CPU weights of at least ``min_bytes`` (default MIN_BYTES) into
    ``arena``.

    A tensor moves when a module holds it as a parameter, buffer or plain attribute, it is
    contiguous, owns its whole storage and no other tensor object reachable from the model
    shares that storage (a view kept elsewhere would go on reading the old copy); a parameter
    keeps its identity (its ``data`` changes). Tensors of embedding modules other than an LM
    head, and those already in an arena, are left alone. Returns the bytes moved.
    """
    holders: dict[int, set[int]] = {}
    for t in _reachable_tensors(model):
        if t.device.type == "cpu" and t.layout == torch.strided and t.numel():
            holders.setdefault(t.untyped_storage().data_ptr(), set()).add(id(t))
    min_bytes = MIN_BYTES if min_bytes is None else min_bytes
    moved = 0
    for slot in _streamed_slots(model):
        t = slot.get()
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or t.layout != torch.strided or nbytes < min_bytes \
                or not t.is_contiguous() or t.untyped_storage().nbytes() != nbytes \
                or len(holders.get(t.untyped_storage().data_ptr(), ())) != 1:
            continue
        slot.put(arena.empty(t.numel(), t.dtype).view(t.shape).copy_(t))
        moved += nbytes
    return moved


def _streamed_slots(model: nn.Module) -> list[MovedTensor]:
    """Each tensor object a module of ``model`` holds directly (parameter, buffer, plain
    attribute) once, outside embedding tables other than LM heads (a tied table counts as the
    head's: heads come first); the KV tensors bound to attention layers are left out."""
    modules = sorted(model.modules(), key=lambda m: not isinstance(m, ParallelLMHead))
    return collect_module_tensors(
        [m for m in modules
         if isinstance(m, ParallelLMHead) or not isinstance(m, VocabParallelEmbedding)],
        lambda t: True)


def _reachable_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor ``model``'s modules hold: parameters, buffers, attributes and tensors up to
    three objects further (packed weights, quantized copies)."""
    tensors = list(model.parameters()) + list(model.buffers())
    seen: set[int] = set()
    for module in model.modules():
        for value in vars(module).values():
            tensors += held_tensors(value, 3, seen)
    return tensors
