"""The CPU attention backend: a native kernel that reads K/V in place through the block table.

Per layer: the new K/V are written through ``slot_mapping`` (one C call,
:meth:`NativeCpuKernels.store_kv`; torch ``index_copy_`` for a quantized cache), then
:meth:`NativeCpuKernels.paged_attention` (``kernels/csrc/cpu_attention.c``) attends every query
token of the mixed batch to its context straight from the paged cache: no gather copy, no
padded query rows, no mask tensor.

A batch of whole prompts of one length (the common offline prefill) takes either the kernel's
prefill tiles or torch's causal SDPA over the prompts' own new K/V (no cache read), whichever
:class:`~kvflow.attention.prefill_select.PrefillAttentionChoice` picks for its dtype, head
shape and prompt-length class (``--cpu-attention auto``: timed on this CPU; ``native`` /
``sdpa`` force one). On a 2-core AVX512-BF16 EPYC the tiles took 0.3-0.6x SDPA's time
(16 prompts of 128-512 tokens, one thread); on a 2-core Xeon with AMX 1.1-3.3x (issue 23).
A sliding window or soft-capped scores (Gemma 2's ``attn_logit_softcapping``, the kernel's
``softcap``) always take the kernel.

A quantized cache (``--kv-cache-dtype int8|fp8_e4m3``, ``kv_scales`` given) is written through
the torch backend's quantizing store and read in place with its scales by
:func:`kvflow.kernels.cpu_attention_kvq.paged_attention_kvq`; whole prompts of one length
attend to their dequantized new K/V in SDPA, as on the torch backend.

Chosen by default on CPU; where the kernels cannot be built (no C compiler) the engine uses the
plain-torch backend (:mod:`kvflow.attention.torch_paged`).

``batch_invariant`` (``--deterministic``): no SDPA shortcut (for a quantized cache), and every
query token is attended alone by the kernel's decode path, so a token's output does not depend
on the batch, its chunk or how its prompt was split (the quantized-cache kernel already works
token by token).
"""

from __future__ import annotations

import torch

from kvflow.attention.backend import AttentionBackend, AttentionMetadata
from kvflow.attention.prefill_select import PrefillAttentionChoice
from kvflow.attention.torch_paged import TorchPagedAttentionBackend
from kvflow.kernels.cpu_attention_kvq import paged_attention_kvq
from kvflow.kernels.cpu_native import NativeCpuKernels


class CpuPagedAttentionBackend(AttentionBackend):
    """Mixed prefill/decode paged attention on CPU with the native kernel (see module doc).

    Args:
        kernels: the native CPU kernels.
        batch_invariant: attend token by token, the same way whatever the batch (see the
            module doc).
        prefill: which attention batches of whole prompts take (default: timed, ``auto``).
    """

    name = "cpu"
    supports_logits_soft_cap = True

    def __init__(self, kernels: NativeCpuKernels, batch_invariant: bool = False,
                 prefill: PrefillAttentionChoice | None = None) -> None:
        self._kernels = kernels
        self.batch_invariant = batch_invariant
        self.prefill = prefill or PrefillAttentionChoice("auto", kernels)

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        uniform = not self.batch_invariant and TorchPagedAttentionBackend.uniform_prompts(meta)
        meta.extra = {"uniform_prompts": uniform, "indices_checked": False}

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window=None,
                kv_scales=None, logits_soft_cap=None) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`; returns a fresh [T, Hq, D] tensor.
        ``logits_soft_cap`` (None: none) soft-caps the scores in the kernel (Gemma 2), which
        then serves whole prompts too (no SDPA shortcut)."""
        slots = meta.slot_mapping
        if kv_scales is None and kv_cache.dtype == k.dtype and slots.dtype == torch.int64 \
                and slots.is_contiguous() and k.stride(-1) == 1 and v.stride(-1) == 1 \
                and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2]:
            # one C call instead of store_kv's two index_copy_ (same bytes)
            self._kernels.store_kv(k, v, kv_cache, slots, meta.num_actual_tokens)
        else:
            k, v = TorchPagedAttentionBackend.store_kv(k, v, kv_cache, meta, kv_scales)
        softcap = float(logits_soft_cap or 0.0)
        if meta.extra["uniform_prompts"] and sliding_window is None and not softcap and (
                kv_scales is not None or self.prefill.pick(
                    q.dtype, q.shape[1], k.shape[1], q.shape[2], meta.max_query_len) == "sdpa"):
            return TorchPagedAttentionBackend.uniform_prompt_attention(q, k, v, meta, scale)
        # The kernel trusts its indices: check them at the first layer of the step only.
        validate = not meta.extra["indices_checked"]
        meta.extra["indices_checked"] = True
        if kv_scales is not None:
            return paged_attention_kvq(self._kernels, q, kv_cache, kv_scales,
                                       meta.query_start_loc, meta.seq_lens, meta.block_table,
                                       scale, sliding_window, validate, softcap)
        return self._kernels.paged_attention(q, kv_cache, meta.query_start_loc, meta.seq_lens,
                                             meta.block_table, scale, sliding_window, validate,
                                             batch_invariant=self.batch_invariant,
                                             softcap=softcap)
