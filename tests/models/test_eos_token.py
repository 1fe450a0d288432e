"""The EOS token id is resolved in one place (``resolve_eos_token_id``): the tokenizer's EOS
wins when it has one, else the model config's (its first element when it lists several).
The expected ids are set by hand in each case."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
from transformers import LlamaConfig, PreTrainedTokenizerFast

from kvflow.config import EngineConfig, SchedulerConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import Scheduler
from kvflow.engine.core_proc import _ready
from kvflow.engine.llm_engine import LLMEngine
from kvflow.engine.messages import EngineReady
from kvflow.engine_outputs import EngineStats
from kvflow.models.loader import resolve_eos_token_id
from tests.core.fake_kv import fake_kv_cache_config


@pytest.fixture(scope="module")
def tokenizer_without_eos(tiny_tokenizer):
    """The tiny tokenizer's vocabulary with no EOS token declared."""
    tok = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer.backend_tokenizer)
    assert tok.eos_token_id is None and len(tok) == len(tiny_tokenizer)
    return tok


@pytest.mark.parametrize("config_eos, expected", [
    (7, 7),
    ([7, 9], 7),        # several EOS ids (Llama 3): the first
    ([], None),
    (None, None),
])
def test_config_eos_without_a_tokenizer(config_eos, expected):
    assert resolve_eos_token_id(None, LlamaConfig(eos_token_id=config_eos)) == expected


def test_tokenizer_eos_wins_over_the_config(tiny_tokenizer):
    assert tiny_tokenizer.eos_token_id == 0  # "<eos>" is the tokenizer's first special token
    assert resolve_eos_token_id(tiny_tokenizer, LlamaConfig(eos_token_id=[5, 6])) == 0
    assert resolve_eos_token_id(tiny_tokenizer, None) == 0


def test_tokenizer_without_eos_falls_back_to_the_config(tokenizer_without_eos):
    assert resolve_eos_token_id(tokenizer_without_eos, LlamaConfig(eos_token_id=[5, 6])) == 5
    assert resolve_eos_token_id(tokenizer_without_eos, LlamaConfig(eos_token_id=3)) == 3
    assert resolve_eos_token_id(tokenizer_without_eos, SimpleNamespace()) is None


def test_async_side_uses_the_core_config_eos(tokenizer_without_eos, tiny_tokenizer):
    """The core process sends the config's id in EngineReady; the API process's tokenizer
    still wins when it has an EOS."""
    kv = KVCacheManager(fake_kv_cache_config(10, 16))
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, 64)
    core = SimpleNamespace(max_model_len=64, hf_config=LlamaConfig(eos_token_id=[5, 6]),
                           num_blocks=10, kv_cache_manager=kv, scheduler=sched, weight_bytes=0,
                           kv_bytes_per_token=0, task="generate", pooler_config=None,
                           max_model_len_note="",
                           config=SimpleNamespace(cache_config=SimpleNamespace(block_size=16)))
    ready = _ready(core)
    idle = EngineStats(num_free_blocks=9, num_usable_blocks=9)  # all but the null block free
    # 32000 and 4096: LlamaConfig's default vocab_size and hidden_size
    assert ready == EngineReady(64, 32000, 5, 10, 16, idle, 0, "generate", None, 4096)
    assert resolve_eos_token_id(tokenizer_without_eos, ready) == 5
    assert resolve_eos_token_id(tiny_tokenizer, ready) == 0


@pytest.fixture(scope="module")
def model_with_eos_list(tiny_llama, tmp_path_factory):
    """The tiny Llama (tokenizer EOS 0) with ``eos_token_id: [5, 0]`` in its config."""
    folder = tmp_path_factory.mktemp("eos_list")
    for name in os.listdir(tiny_llama.path):
        shutil.copy(os.path.join(tiny_llama.path, name), folder / name)
    with open(folder / "config.json") as f:
        config = json.load(f)
    config["eos_token_id"] = [5, 0]
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    return str(folder)


@pytest.mark.parametrize("skip_tokenizer_init, expected", [(True, 5), (False, 0)])
def test_llm_engine_resolves_eos(model_with_eos_list, skip_tokenizer_init, expected):
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=model_with_eos_list, dtype="float32", num_kv_blocks=16,
        skip_tokenizer_init=skip_tokenizer_init))
    assert engine.processor.eos_token_id == expected
