"""vLLM's ``token_embed`` with ``dimensions`` (Matryoshka): each prompt token's row cut to the
first D values, then L2-normalized (vLLM's order; ``normalize=False``: cut only), against
sentence-transformers' own per-token output (``encode(output_value="token_embeddings")``: the
Transformer module's rows before pooling) cut and normalized by hand, on a tiny random bare
Llama decoder declaring ``is_matryoshka`` (any D) and a BERT encoder declaring
``matryoshka_dimensions`` (those D only; another is refused naming ``dimensions``)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from kvflow import LLM, PoolingParams
from tests.models.embedding_models import build_bert, build_decoder

SENTENCES = ["the quick brown fox jumps over the lazy dog", "keys and values in blocks"]
ATOL = 2e-5  # float32 rounding of two implementations (as tests/models/test_embeddings.py)


def st_token_rows(st, sentence: str) -> torch.Tensor:
    """[T, H] float32: sentence-transformers' token embeddings of one sentence."""
    return st.encode([sentence], output_value="token_embeddings")[0].float()


def _rows(llm: LLM, params: PoolingParams) -> list[torch.Tensor]:
    return [o.outputs.data for o in llm.encode(SENTENCES, params, pooling_task="token_embed",
                                               use_tqdm=False)]


def test_matryoshka_decoder_token_embed_dimensions(tiny_tokenizer, tmp_path, assert_no_leaks):
    folder = str(tmp_path / "st")
    st = build_decoder(tiny_tokenizer, folder, "mean")  # config.json: is_matryoshka
    llm = LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=64,
              max_num_batched_tokens=8, block_size=4)  # prompts over two chunks or more
    refs = [st_token_rows(st, s) for s in SENTENCES]
    assert all(r.shape[0] > 8 for r in refs)
    for dims in (16, 33):
        for got, ref in zip(_rows(llm, PoolingParams(dimensions=dims)), refs):
            assert got.shape == (ref.shape[0], dims)
            torch.testing.assert_close(got, F.normalize(ref[:, :dims], dim=-1), atol=ATOL,
                                       rtol=1e-4)
            # cut then normalized: not the full row normalized then cut
            assert (got.norm(dim=-1) - 1).abs().max() < 1e-5
        for got, ref in zip(_rows(llm, PoolingParams(dimensions=dims, normalize=False)), refs):
            torch.testing.assert_close(got, ref[:, :dims], atol=ATOL, rtol=1e-4)
    assert_no_leaks(llm)


def test_bert_token_embed_dimensions(tiny_tokenizer, tmp_path, assert_no_leaks):
    folder = str(tmp_path / "st")
    st = build_bert(tiny_tokenizer, folder, "cls")
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, "matryoshka_dimensions": [16, 32, 64]}, f)
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=64)
    refs = [st_token_rows(st, s) for s in SENTENCES]
    for dims in (32, None):
        for got, ref in zip(_rows(llm, PoolingParams(dimensions=dims)), refs):
            assert got.shape == (ref.shape[0], dims or 64)
            torch.testing.assert_close(got, F.normalize(ref[:, :dims], dim=-1), atol=ATOL,
                                       rtol=1e-4)
    with pytest.raises(ValueError, match=r"dimensions=20 is not supported by this model "
                                         r"\(choose \[16, 32, 64\]\)"):
        llm.encode(SENTENCES[0], PoolingParams(dimensions=20), pooling_task="token_embed",
                   use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert_no_leaks(llm)
