"""Streamed CPU weights moved onto huge pages after loading (kvflow/worker/cpu_weight_pages.py):
which tensors move (hand-counted bytes), that values and parameter identities survive, and that
aliased tensors and embedding tables stay put."""

from __future__ import annotations

import torch
from torch import nn

from kvflow.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvflow.platforms.cpu_memory import HugePageArena
from kvflow.worker.cpu_weight_pages import place_weights_on_huge_pages


class Holder:
    """An object a module keeps, holding a tensor (as a quantized method's cache would)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.up = nn.Linear(256, 128, bias=False)  # 128 KiB fp32: moves
        self.down = nn.Linear(128, 64, bias=False)  # 32 KiB: under MIN_BYTES, stays
        self.q = nn.Parameter(torch.randint(-128, 127, (512, 256), generator=gen,
                                            dtype=torch.int8), requires_grad=False)  # 128 KiB
        self.register_buffer("table", torch.randn(64, 1024, generator=gen))  # 256 KiB: moves
        self.scales = torch.randn(32, 1024, generator=gen)  # attribute, 128 KiB: moves
        self.aliased = nn.Parameter(torch.randn(256, 256, generator=gen), requires_grad=False)
        self.alias_view = Holder(self.aliased.data[:10])  # shares aliased's storage: both stay
        self.embed = VocabParallelEmbedding(300, 64)  # 75 KiB table, looked up: stays
        self.head = ParallelLMHead(300, 64)
        self.head.weight = self.embed.weight  # tied: the head's, streamed: moves


def test_moves_streamed_weights_and_keeps_values_and_identities():
    model = Toy()
    with torch.no_grad():
        model.embed.weight.normal_()
    before = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    scales = model.scales.clone()
    params = {n: p for n, p in model.named_parameters()}
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    arena = HugePageArena(segment_bytes=4 << 20)
    moved = place_weights_on_huge_pages(model, arena)
    # up 128 KiB + q 128 KiB + table 256 KiB + scales 128 KiB + tied head/embed 75 KiB
    assert moved == (128 + 128 + 256 + 128) * 1024 + 300 * 64 * 4
    for n, p in model.named_parameters():
        assert p is params[n] and torch.equal(p, before[n])  # same Parameter, same values
    assert torch.equal(model.table, before["table"]) and torch.equal(model.scales, scales)
    stayed = {"down.weight", "aliased"}
    assert {n for n in ptrs if params[n].data_ptr() != ptrs[n]} == set(ptrs) - stayed
    segment = model.up.weight.untyped_storage().data_ptr()
    for t in (model.q, model.table, model.scales, model.head.weight):
        assert t.untyped_storage().data_ptr() == segment  # side by side in one segment
    assert model.embed.weight is model.head.weight  # still tied
    assert model.alias_view.t.data_ptr() == model.aliased.data_ptr()  # the view still aliases


def test_min_bytes_and_an_empty_arena_use():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(64, 64))
    assert place_weights_on_huge_pages(model, HugePageArena(), min_bytes=1 << 30) == 0
    assert place_weights_on_huge_pages(model, HugePageArena(), min_bytes=64 * 64 * 4) == \
        64 * 64 * 4


def test_int8_engine_runs_on_the_moved_weights(tiny_llama, monkeypatch):
    from kvflow import LLM, SamplingParams
    from kvflow.worker import cpu_weight_pages

    def run():
        llm = LLM(model=tiny_llama.path, quantization="int8", kv_cache_memory="16MiB",
                  enable_prefix_caching=False)
        out = llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=6, temperature=0),
                           use_tqdm=False)
        model = llm.engine.core.executor.runner.model
        int8 = [p for m in model.modules() for p in m.parameters(recurse=False)
                if p.dtype == torch.int8 and p.dim() == 2
                and not isinstance(m, VocabParallelEmbedding)]  # tables are looked up
        return [o.outputs[0].token_ids for o in out], int8

    monkeypatch.setattr(cpu_weight_pages, "MIN_BYTES", 1 << 10)  # the tiny layers move too
    moved_tokens, int8 = run()
    assert len(int8) >= 4 and len({p.untyped_storage().data_ptr() for p in int8}) == 1
    monkeypatch.setattr(cpu_weight_pages, "MIN_BYTES", 1 << 40)  # nothing moves
    kept_tokens, int8 = run()
    assert len({p.untyped_storage().data_ptr() for p in int8}) == len(int8)
    assert moved_tokens == kept_tokens  # exact copies: the same greedy tokens
