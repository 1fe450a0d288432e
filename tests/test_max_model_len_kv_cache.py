"""An explicit ``max_model_len`` the KV cache cannot hold is refused at start-up, as vLLM's
``_check_enough_kv_cache_memory`` refuses it (``num_gpu_blocks_override``, kvflow's
``--num-kv-blocks``, included): it was capped with a warning, so ``--max-model-len 64`` served
12 tokens. Unset or -1 (vLLM's auto-fit) it is still capped at what one request can hold.
Capacities are counted by hand: (blocks - 1, the null block) x block_size tokens."""

from __future__ import annotations

import json
import logging
import os

import pytest

from kvflow import LLM
from kvflow.config import EngineConfig
from kvflow.core.kv_cache_sizing import model_len_refusal
from kvflow.entrypoints.cli import main
from kvflow.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

BS = 4


def _llm(path: str, **kwargs) -> LLM:
    return LLM(model=path, dtype="float32", device="cpu", block_size=BS, **kwargs)


def _hf_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _block_bytes(path: str) -> int:
    """One block's K and V over every layer, float32, from the model's config.json."""
    cfg = _hf_config(path)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * BS * 4


def test_explicit_max_model_len_past_the_pool_is_refused(tiny_llama):
    """4 blocks of 4 tokens: 3 usable (block 0 is the null block), 12 tokens per request; 64
    tokens need 16 blocks. The message names max_model_len, the blocks and bytes needed and
    available, the estimated maximum length and what to change."""
    page = _block_bytes(tiny_llama.path)
    with pytest.raises(ValueError) as e:
        _llm(tiny_llama.path, num_kv_blocks=4, max_model_len=64)
    assert str(e.value) == (
        f"max_model_len=64 does not fit the KV cache: one request of 64 tokens needs 16 "
        f"blocks of 4 tokens ({16 * page} bytes of KV cache), more than the 3 usable blocks "
        f"({3 * page} bytes; block 0 is the null block), which hold 12 tokens per request: "
        "the estimated maximum model length is 12. Raise --num-kv-blocks (to at least 17: "
        "block 0 is the null block); or lower --max-model-len to 12 or less (or leave it "
        "unset, or -1, to cap it at what the KV cache holds)")


def test_the_bounds_the_refusal_names_are_exact(tiny_llama):
    """The blocks it asks for are enough (17 hold 16 x 4 = 64 tokens), one fewer is refused;
    the length it names is served by the pool it refused."""
    assert _llm(tiny_llama.path, num_kv_blocks=17, max_model_len=64).engine.core.max_model_len \
        == 64
    with pytest.raises(ValueError, match=r"max_model_len=64 does not fit .* the 15 usable "):
        _llm(tiny_llama.path, num_kv_blocks=16, max_model_len=64)
    assert _llm(tiny_llama.path, num_kv_blocks=4, max_model_len=12).engine.core.max_model_len \
        == 12


def test_kv_cache_memory_is_the_setting_named(tiny_llama):
    """A pool sized from --kv-cache-memory (4 blocks' bytes) names that setting."""
    page = _block_bytes(tiny_llama.path)
    with pytest.raises(ValueError, match=r"the estimated maximum model length is 12\. Raise "
                                         rf"--kv-cache-memory \(now {4 * page}\); or lower "):
        _llm(tiny_llama.path, kv_cache_memory=4 * page, max_model_len=64)


def test_max_model_len_past_the_positions_names_their_source(tiny_llama):
    """One token past the model's positions (config.json's max_position_embeddings, no RoPE
    scaling) is refused naming that field, not a "yarn / dynamic rope_scaling" the model
    does not have."""
    positions = _hf_config(tiny_llama.path)["max_position_embeddings"]
    with pytest.raises(ValueError) as e:
        _llm(tiny_llama.path, max_model_len=positions + 1)
    assert str(e.value) == (f"max_model_len={positions + 1} exceeds the positions the model "
                            f"covers ({positions}: the model's max_position_embeddings)")


@pytest.mark.parametrize("max_model_len", [None, -1], ids=["unset", "auto"])
def test_unset_or_auto_is_capped_at_the_pool(tiny_llama, caplog, max_model_len):
    """Unset or -1: the model's positions (config.json's max_position_embeddings, 256)
    capped at 3 x 4 = 12 tokens, with the warning (vLLM's auto-fit)."""
    positions = _hf_config(tiny_llama.path)["max_position_embeddings"]
    assert positions > 12
    kwargs = {} if max_model_len is None else {"max_model_len": max_model_len}
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        llm = _llm(tiny_llama.path, num_kv_blocks=4, **kwargs)
    assert llm.engine.core.max_model_len == 12
    assert f"max_model_len {positions} exceeds the KV cache (12 tokens); capping it" in caplog.text


def _config(**cache) -> EngineConfig:
    return EngineConfig.from_kwargs(model="m", block_size=BS, max_num_batched_tokens=16,
                                    **cache)


def _pool(num_blocks: int) -> KVCacheConfig:
    """One full-attention group of one layer: 1 KV head of 8 float32 values, 256 bytes a
    block."""
    import torch

    spec = FullAttentionSpec(BS, 1, 8, torch.float32)
    return KVCacheConfig(num_blocks, (KVCacheGroupSpec(("l0",), spec),))


@pytest.mark.parametrize("cache, fixed, fix", [
    ({}, None, ("Raise --gpu-memory-utilization (now 0.9), or set --kv-cache-memory or "
                "--num-kv-blocks;")),
    ({}, 2 * 2**30, ("Set --kv-cache-memory (the KV cache is 2.00 GiB by default here) or "
                     "--num-kv-blocks;")),
    ({"gpu_memory_utilization": 0.5}, None, "Raise --gpu-memory-utilization (now 0.5), or"),
])
def test_the_refusal_names_the_setting_that_sized_the_pool(cache, fixed, fix):
    """A GPU's pool comes from --gpu-memory-utilization, a CPU's from a fixed budget: each
    names its own. 8 blocks (7 usable, 28 tokens) of 256 bytes; 100 tokens need 25."""
    message = model_len_refusal(_config(**cache), _pool(8), 100, 28, fixed)
    assert message.startswith(
        "max_model_len=100 does not fit the KV cache: one request of 100 tokens needs 25 "
        f"blocks of 4 tokens ({25 * 256} bytes of KV cache), more than the 7 usable blocks "
        f"({7 * 256} bytes; block 0 is the null block), which hold 28 tokens per request: "
        "the estimated maximum model length is 28. ")
    assert fix in message


def test_the_cli_exits_with_one_line(tiny_llama, capsys):
    rc = main(["generate", "--model", tiny_llama.path, "--dtype", "float32", "--block-size",
               "4", "--num-kv-blocks", "4", "--max-model-len", "64", "--prompt", "the lazy fox",
               "--max-tokens", "1"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("kvflow: error: --max-model-len=64 does not fit the KV cache: "
                               "one request of 64 tokens needs 16 blocks")
    assert "the estimated maximum model length is 12. Raise --num-kv-blocks" in lines[0]


def test_serve_exits_with_one_line(tiny_llama, capfd):
    """``kvflow serve`` (its engine core in a process of its own) exits 2 with the refusal as
    its only line at --uvicorn-log-level warning (at info, the core's start-up lines come
    first: the pool is sized once the weights are loaded)."""
    rc = main(["serve", tiny_llama.path, "--port", "0", "--device", "cpu", "--dtype", "float32",
               "--block-size", "4", "--num-kv-blocks", "4", "--max-model-len", "64",
               "--port", "9", "--uvicorn-log-level", "warning"])
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("kvflow: error: --max-model-len=64 does not fit the KV cache: "
                               "one request of 64 tokens needs 16 blocks")
