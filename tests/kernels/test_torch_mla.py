"""The torch MLA backend (absorbed multi-head latent attention over a paged latent cache)
against the plain-torch paged-attention reference on an equivalent one-KV-head K/V cache:
keys are the cached vectors, values their first ``kv_lora_rank`` entries. The backend must
write the new vectors through ``slot_mapping`` and read every context vector through the block
table, for prefill chunks, decodes and a mix."""

from __future__ import annotations

import pytest
import torch

from kvflow.attention.backend import AttentionMetadata
from kvflow.attention.torch_mla import TorchMLABackend
from kvflow.kernels.attention_ref import paged_attention_ref
from tests.kernels.paged_batch import make_batch

RANK, ROPE = 24, 8  # kv_lora_rank, qk_rope_head_dim


def _new_token_slots(batch: dict, block_size: int) -> torch.Tensor:
    """The cache slot of every query token (the last query_len positions of each request)."""
    slots = []
    qsl = batch["query_start_loc"].tolist()
    for i, seq_len in enumerate(batch["seq_lens"].tolist()):
        for pos in range(seq_len - (qsl[i + 1] - qsl[i]), seq_len):
            block = int(batch["block_table"][i, pos // block_size])
            slots.append(block * block_size + pos % block_size)
    return torch.tensor(slots, dtype=torch.int64)


def _reference(batch: dict, latent_cache: torch.Tensor) -> torch.Tensor:
    """Per-request loop (kvflow.kernels.attention_ref) on K = the vectors, V = their latent
    part zero-padded to the key width; returns [T, H, RANK]."""
    values = torch.cat([latent_cache[..., :RANK], torch.zeros_like(latent_cache[..., RANK:])],
                       dim=-1)
    kv_cache = torch.stack([latent_cache, values]).unsqueeze(-2)  # [2, nb, bs, 1, D]
    out = paged_attention_ref(batch["q"], kv_cache, batch["query_start_loc"], batch["seq_lens"],
                              batch["block_table"], batch["max_query_len"],
                              batch["max_seq_len"], batch["scale"])
    return out[..., :RANK]


@pytest.mark.parametrize("reqs", [
    [(0, 7), (5, 3), (16, 1), (30, 12)],  # mixed: whole prompt, chunks, a decode
    [(9, 1), (0, 1), (33, 1)],             # all decode
    [(0, 11), (0, 11)],                     # whole prompts of one length
], ids=["mixed", "decode", "uniform_prompts"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_reference_and_writes_slots(reqs, block_size):
    batch = make_batch(reqs, num_heads=6, num_kv_heads=1, head_dim=RANK + ROPE,
                       block_size=block_size, seed=len(reqs) + block_size)
    full = batch["kv_cache"][0, :, :, 0]  # [nb, bs, D]: every context vector
    full = torch.nan_to_num(full, nan=7.0)  # unwritten slots: large values, masked or not
    slots = _new_token_slots(batch, block_size)
    new_vectors = full.view(-1, RANK + ROPE)[slots].clone()
    cache = full.clone()
    cache.view(-1, RANK + ROPE)[slots] = -5.0  # the step's vectors are not cached yet
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=batch["query_start_loc"],
                             seq_lens=batch["seq_lens"], block_table=batch["block_table"],
                             max_query_len=batch["max_query_len"],
                             max_seq_len=batch["max_seq_len"], num_actual_tokens=len(slots))
    backend = TorchMLABackend()
    backend.prepare(meta, block_size)
    out = backend.forward(batch["q"], new_vectors, cache, meta, batch["scale"], RANK)
    assert torch.equal(cache, full)  # written through slot_mapping, nothing else touched
    assert out.shape == (len(slots), 6, RANK)
    torch.testing.assert_close(out, _reference(batch, full), atol=2e-5, rtol=1e-5)
