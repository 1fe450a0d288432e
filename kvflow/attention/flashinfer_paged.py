"""FlashInfer paged-attention backend (``--attention-backend flashinfer``, CUDA only).

FlashInfer (Ye et al., "FlashInfer: Efficient and Customizable Attention Engine for LLM
Inference Serving", 2025, arXiv:2501.01005; ``flashinfer-python`` on PyPI, JIT-compiled for
the device) reads a paged KV cache through a CSR page table instead of kvflow's padded
``block_table``. What is kvflow's here, and tested on CPU, is the conversion
(:func:`paged_kv_layout`): request ``i``'s ``seq_lens[i]`` tokens fill
``ceil(seq_lens[i] / block_size)`` pages, listed in order in
``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`` (its first block-table entries), the last one
holding ``kv_last_page_len[i]`` tokens (1..block_size). kvflow's per-layer cache
``[2, num_blocks, block_size, Hkv, D]`` is FlashInfer's NHD layout as the pair
``(kv_cache[0], kv_cache[1])``, each ``[num_pages, page_size, Hkv, D]``, with no copy; the query
tokens of request ``i`` are ``query_start_loc[i]:query_start_loc[i + 1]`` (FlashInfer's
``qo_indptr``) and sit at the end of its context, which is FlashInfer's causal alignment.
kvflow's ``sliding_window = W`` (keys in ``(p - W, p]``) is FlashInfer's ``window_left = W - 1``.

The FlashInfer calls themselves have not run yet (no GPU in the session that wrote them):
all-decode steps use ``BatchDecodeWithPagedKVCacheWrapper``, other steps
``BatchPrefillWithPagedKVCacheWrapper`` (causal); each wrapper is planned once per step and
head configuration and run by every layer. New K/V are written by kvflow's Triton store
kernel. Not supported (refused): quantized KV caches, CUDA graphs (the plan is host work per
step; the engine runs this backend eagerly).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from kvflow.attention.backend import AttentionBackend, AttentionMetadata

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended float workspace per wrapper


class PagedKVLayout(NamedTuple):
    """FlashInfer's page table of one step (all int32, on the metadata's device).

    Attributes:
        kv_indptr: [num_reqs + 1]; request ``i``'s pages are
            ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``.
        kv_indices: [kv_indptr[-1]] physical block ids, request by request, in order.
        kv_last_page_len: [num_reqs] tokens in each request's last page (1..block_size).
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


def paged_kv_layout(block_table: torch.Tensor, seq_lens: torch.Tensor,
                    block_size: int) -> PagedKVLayout:
    """kvflow's ``block_table`` / ``seq_lens`` -> FlashInfer's CSR page table (module doc).

    Args:
        block_table: int32 [num_reqs, max_blocks]; row ``i`` holds at least
            ``ceil(seq_lens[i] / block_size)`` valid block ids (the rest is padding).
        seq_lens: int32 [num_reqs], each >= 1 (context tokens after this step).
        block_size: tokens per KV block (FlashInfer's ``page_size``).

    Returns:
        :class:`PagedKVLayout` (int32 tensors on ``block_table``'s device).

    Raises:
        ValueError: on a seq_len < 1 or one whose blocks exceed the block table's width.
    """
    seq_lens = seq_lens.to(torch.int32)
    num_pages = (seq_lens + block_size - 1) // block_size
    if seq_lens.numel() and (int(seq_lens.min()) < 1 or
                             int(num_pages.max()) > block_table.shape[1]):
        raise ValueError(f"seq_lens must be >= 1 and fit the block table's "
                         f"{block_table.shape[1]} blocks of {block_size} tokens")
    kv_indptr = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    torch.cumsum(num_pages, 0, out=kv_indptr[1:])
    columns = torch.arange(block_table.shape[1], device=block_table.device)
    used = columns[None, :] < num_pages[:, None].to(block_table.device)
    kv_indices = block_table[used].to(torch.int32)  # row-major: request by request
    kv_last_page_len = seq_lens - (num_pages - 1) * block_size
    return PagedKVLayout(kv_indptr.to(block_table.device), kv_indices,
                         kv_last_page_len.to(block_table.device))


def _import_flashinfer() -> Any:
    """The ``flashinfer`` module.

    Raises:
        ValueError: when it is not installed (saying what to install).
    """
    try:
        import flashinfer
    except ImportError as exc:
        raise ValueError("--attention-backend flashinfer needs the flashinfer-python package "
                         "(pip install 'kvflow[flashinfer]'); it is not installed") from exc
    return flashinfer


class FlashInferPagedAttentionBackend(AttentionBackend):
    """Paged attention through FlashInfer's wrappers (module docstring; unmeasured, CUDA only).

    Args:
        device: the engine's device; FlashInfer's kernels are CUDA-only.

    Raises:
        ValueError: on a non-CUDA device, or when flashinfer is not importable.
    """

    name = "flashinfer"
    supports_cuda_graphs = False

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"--attention-backend flashinfer runs on CUDA devices only "
                             f"(FlashInfer's kernels are CUDA kernels); this engine runs on "
                             f"{device.type}: use triton, torch or cpu")
        self._flashinfer = _import_flashinfer()
        self._step = 0
        self._block_size = 0
        # (decode?, Hq, Hkv, D, dtype, window_left, scale) -> [wrapper, step it is planned for]
        self._wrappers: dict[tuple, list] = {}

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Build the step's FlashInfer page table once (stored in ``meta.extra``)."""
        self._step += 1
        self._block_size = block_size
        meta.extra = dict(meta.extra or {})
        meta.extra["flashinfer_step"] = self._step
        meta.extra["flashinfer_layout"] = paged_kv_layout(meta.block_table, meta.seq_lens,
                                                          block_size)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`.

        Raises:
            ValueError: for a quantized KV cache (``kv_scales``), which this backend does not
                read.
        """
        if kv_scales is not None:
            raise ValueError("--attention-backend flashinfer does not read quantized KV "
                             "caches (int8/fp8_e4m3 with per-token scales); use triton")
        from kvflow.kernels.kv_store import store_kvcache

        store_kvcache(k, v, kv_cache, meta.slot_mapping)
        num_tokens = meta.num_actual_tokens
        wrapper = self._planned(q, kv_cache, meta, scale, sliding_window)
        out = torch.zeros_like(q) if num_tokens < q.shape[0] else None
        result = wrapper.run(q[:num_tokens].contiguous(), (kv_cache[0], kv_cache[1]))
        if out is None:
            return result
        out[:num_tokens] = result
        return out

    def _planned(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, sliding_window: int | None) -> Any:
        """The wrapper for this head configuration, planned for this step (once per step)."""
        window_left = sliding_window - 1 if sliding_window else -1
        key = (meta.is_all_decode, q.shape[1], kv_cache.shape[3], q.shape[2], q.dtype,
               window_left, scale)
        entry = self._wrappers.get(key)
        if entry is None:
            entry = self._wrappers[key] = [self._new_wrapper(key, q.device), -1]
        step = meta.extra["flashinfer_step"]
        if entry[1] != step:
            self._plan(entry[0], key, kv_cache.dtype, meta)
            entry[1] = step
        return entry[0]

    def _new_wrapper(self, key: tuple, device: torch.device) -> Any:
        decode, num_heads, num_kv_heads = key[0], key[1], key[2]
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        if decode:  # tensor cores pay from GQA groups of 4 (vLLM's rule)
            return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=num_heads // num_kv_heads >= 4)
        return self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def _plan(self, wrapper: Any, key: tuple, kv_dtype: torch.dtype,
              meta: AttentionMetadata) -> None:
        decode, num_heads, num_kv_heads, head_dim, dtype, window_left, scale = key
        layout: PagedKVLayout = meta.extra["flashinfer_layout"]
        common = {"sm_scale": scale, "window_left": window_left, "q_data_type": dtype,
                  "kv_data_type": kv_dtype}
        if decode:
            wrapper.plan(layout.kv_indptr, layout.kv_indices, layout.kv_last_page_len,
                         num_heads, num_kv_heads, head_dim, self._block_size, **common)
        else:
            wrapper.plan(meta.query_start_loc, layout.kv_indptr, layout.kv_indices,
                         layout.kv_last_page_len, num_heads, num_kv_heads, head_dim,
                         self._block_size, causal=True, **common)
