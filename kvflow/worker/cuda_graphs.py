"""CUDA graphs for all-decode steps.

A decode step of ``B`` requests is the same sequence of kernels for every step with that ``B``,
so it is captured once per padded batch size (1, 2, 4, 8, then multiples of 16 up to
``max_num_seqs``) and replayed: the host launches one graph instead of hundreds of kernels.
Inputs are copied into static buffers first. Padding rows write their K/V nowhere
(``slot_mapping = -1``) and attend to the null block, and their outputs are dropped. A model
that also returns aux hidden states (an EAGLE-3 target's layer taps) copies them into static
outputs of their own inside the graph.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.attention.backend import AttentionMetadata
from kvflow.attention.layer import AttentionContext


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then steps of 16 up to max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class CudaGraphRunner:
    """Captures ``model.forward`` for decode batches and replays it.

    Args:
        model: the causal LM (``forward(input_ids, positions) -> hidden``).
        attn_ctx: the engine's attention context (its backend must be graph-safe: no host syncs,
            launch grids fixed by the batch size and ``max_seq_len``).
        max_num_seqs: largest batch to capture.
        max_blocks_per_seq: block-table width (max_model_len / block_size, rounded up).
        max_model_len: the ``max_seq_len`` the captured kernels are sized for (tokens).
        block_size: tokens per KV block.
        hidden_size: model width.
        device / dtype: where and in which dtype the model runs.
    """

    def __init__(self, model: nn.Module, attn_ctx: AttentionContext, max_num_seqs: int,
                 max_blocks_per_seq: int, max_model_len: int, block_size: int,
                 hidden_size: int, device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.attn_ctx = model, attn_ctx
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len, self.block_size = max_model_len, block_size
        n = self.sizes[-1]
        i32 = {"dtype": torch.int32, "device": device}
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, **i32)
        self.block_table = torch.zeros(n, max_blocks_per_seq, **i32)
        self.query_start_loc = torch.arange(n + 1, **i32)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        # EAGLE-3's taps (``LlamaModel.aux_hidden_state_layers``): static outputs too
        layers = getattr(getattr(model, "model", None), "aux_hidden_state_layers", ())
        self.aux = [torch.zeros(n, hidden_size, dtype=dtype, device=device) for _ in layers]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.metas: dict[int, AttentionMetadata] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_table=self.block_table[:size],
            max_query_len=1, max_seq_len=self.max_model_len, num_actual_tokens=size)

    def _forward(self, size: int) -> None:
        meta = self.metas[size]
        with self.attn_ctx.forward_context.bind([meta]):  # one KV-cache group
            out = self.model(self.input_ids[:size], self.positions[:size])
            if isinstance(out, tuple):  # (hidden, aux hidden states)
                out, aux = out
                for static, tap in zip(self.aux, aux, strict=True):
                    static[:size] = tap
            self.hidden[:size] = out

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first, sharing one memory pool."""
        pool = None
        for size in reversed(self.sizes):
            self.metas[size] = meta = self._meta(size)
            self.attn_ctx.backend.prepare(meta, self.block_size)
            for _ in range(2):  # warm-up: compile kernels, settle allocations
                self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (bool(self.graphs) and meta.max_query_len == 1
                and meta.num_reqs <= self.sizes[-1]
                and meta.block_table.shape[1] <= self.block_table.shape[1])

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Replay the smallest captured size >= the batch; returns hidden [num_reqs, hidden]
        (with a model returning aux hidden states, EAGLE-3's taps: ``(hidden, [num_reqs,
        hidden] each)``, views of the static outputs)."""
        n = meta.num_reqs
        size = next(s for s in self.sizes if s >= n)
        width = meta.block_table.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:size].fill_(1)
        self.block_table[:n, :width].copy_(meta.block_table)
        self.block_table[n:size].zero_()
        self.graphs[size].replay()
        if self.aux:
            return self.hidden[:n], [static[:n] for static in self.aux]
        return self.hidden[:n]
