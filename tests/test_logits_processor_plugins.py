"""Logits processor plugins: the ``kvflow.logits_processors`` entry-point group (vLLM's
``vllm.logits_processors`` under kvflow's name), looked for at start-up once the task is
known (``EngineConfig.find_logits_processor_plugins``; only a generating engine loads them).
Each test writes a distribution's ``.dist-info`` (METADATA, entry_points.txt) and the
plugin's module into a tmp dir put on ``sys.path``, as ``pip install`` would leave them.
Oracles: the greedy tokens of a plain torch loop over transformers' logits with the banned
token (``tests.test_logits_processors._reference``), hand-written class-path lists,
sentence-transformers' and transformers' embeddings (mean / last-token pooling)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig
from kvflow.logits_process import LOGITS_PROCESSORS_GROUP, plugin_logits_processors
from tests.test_logits_processors import _reference

BAN = "tests.test_logits_processors:BanToken"
FORCE = "tests.test_logits_processors:ForceEvery"


def install(root: Path, monkeypatch, entry_points: dict[str, str], dist: str = "lp-plugin"
            ) -> None:
    """A distribution ``dist`` whose ``kvflow.logits_processors`` entry points are
    ``entry_points`` (name -> "module:Class"), installed into ``root`` on sys.path."""
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = [f"[{LOGITS_PROCESSORS_GROUP}]"] + [f"{k} = {v}" for k, v in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(root))


def _found(task: str = "generate", **kwargs) -> EngineConfig:
    """An EngineConfig after the engine core's lookup for ``task``."""
    config = EngineConfig.from_kwargs(**kwargs)
    assert config.model_config.logits_processor_plugins is None  # not before the task
    config.find_logits_processor_plugins(task)
    return config


def test_no_plugin_installed_finds_none():
    assert plugin_logits_processors() == []
    assert _found().model_config.logits_processor_plugins == []


def test_an_installed_plugin_runs_without_the_flag(tiny_llama, tiny_tokenizer, tmp_path,
                                                   monkeypatch):
    """The plugin's module lives in the tmp dir too; a request's extra_args reach it as a
    configured processor's do (without a processor they would be refused)."""
    (tmp_path / "kvflow_lp_plugin_mod.py").write_text(
        "from tests.test_logits_processors import BanToken as Ban  # noqa: F401\n")
    install(tmp_path, monkeypatch, {"ban": "kvflow_lp_plugin_mod:Ban"})
    assert plugin_logits_processors() == ["kvflow_lp_plugin_mod:Ban"]
    ids = tiny_tokenizer.encode("the quick brown fox")
    plain = _reference(tiny_llama.hf_model, ids, 6)
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=16,
              block_size=4)
    assert llm.engine.config.model_config.custom_logits_processors() == \
        ["kvflow_lp_plugin_mod:Ban"]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                             extra_args={"ban_token": plain[0]}),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": ids}] * 2, params, use_tqdm=False)
    banned = _reference(tiny_llama.hf_model, ids, 6, ban=plain[0])
    assert banned != plain
    assert [o.outputs[0].token_ids for o in outs] == [banned, plain]


def test_plugins_run_before_the_configured_ones_each_once(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, {"force": FORCE, "again": FORCE})
    mc = _found(logits_processors=[BAN, FORCE]).model_config
    assert (mc.logits_processor_plugins, mc.logits_processors) == ([FORCE], [BAN, FORCE])
    assert mc.custom_logits_processors() == [FORCE, BAN]


def test_a_broken_plugin_stops_the_start_naming_it(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, {"broken": "no_such_module_lp_q:Thing"})
    config = EngineConfig.from_kwargs()  # the task is not known yet: nothing imported
    with pytest.raises(ValueError) as e:
        config.find_logits_processor_plugins("generate")
    assert str(e.value).startswith("logits processor plugin 'broken' = "
                                   "'no_such_module_lp_q:Thing' (entry point group "
                                   "'kvflow.logits_processors'): ")
    assert "cannot import module 'no_such_module_lp_q'" in str(e.value)


def test_speculative_decoding_skips_plugins_with_a_warning(tmp_path, monkeypatch, caplog):
    """vLLM v1 skips its plugins there too; the engine starts without them (a flag-named
    processor is refused: tests/test_logits_processors.py)."""
    install(tmp_path, monkeypatch, {"ban": BAN})
    with caplog.at_level(logging.WARNING, logger="kvflow.config.engine"):
        config = _found(speculative_config={"method": "ngram"})
    assert config.model_config.logits_processor_plugins == []
    assert config.model_config.custom_logits_processors() == []
    assert f"logits processor plugins {BAN} (entry point group kvflow.logits_processors) " \
        "are not loaded" in caplog.text


def test_speculative_decoding_starts_with_a_broken_plugin(tmp_path, monkeypatch, caplog):
    """Skipped means not imported either: vLLM v1 returns before loading its plugins with
    speculative decoding, so a plugin that does not import stopped kvflow's start only."""
    install(tmp_path, monkeypatch, {"broken": "no_such_module_lp_s:Thing"})
    with caplog.at_level(logging.WARNING, logger="kvflow.config.engine"):
        config = _found(speculative_config={"method": "ngram"})
    assert config.model_config.custom_logits_processors() == []
    assert "logits processor plugins no_such_module_lp_s:Thing (entry point group " \
        "kvflow.logits_processors) are not loaded" in caplog.text
    with pytest.raises(ValueError, match="^logits processor plugin 'broken'"):
        _found()  # without speculation it still stops the start


def test_a_pooling_model_skips_plugins_and_refuses_the_flag(tiny_tokenizer, tmp_path,
                                                             monkeypatch):
    """An embedding model samples nothing: with a plugin installed it starts and embeds as
    sentence-transformers does; a processor named by the flag stops the start naming it."""
    from tests.models.embedding_models import build_bert, st_embed

    folder = str(tmp_path / "st")
    st = build_bert(tiny_tokenizer, folder, "mean")
    install(tmp_path / "site", monkeypatch, {"ban": BAN})
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=64)
    assert llm.engine.config.model_config.logits_processor_plugins == []  # not looked for
    assert llm.engine.core.executor.runner.logits_procs is None
    got = llm.embed(["the quick brown fox"], use_tqdm=False)[0].outputs.embedding
    ref = st_embed(st, ["the quick brown fox"])[0]
    assert max(abs(a - float(b)) for a, b in zip(got, ref, strict=True)) < 2e-5
    with pytest.raises(ValueError, match=r"^--logits-processors \(logits_processors\): a "
                                         r"pooling model"):
        LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=64,
            logits_processors=[BAN])


def test_a_broken_plugin_stops_only_a_generating_start(tiny_llama, tiny_tokenizer, tmp_path,
                                                       monkeypatch):
    """The task is known before the plugins are looked up (as in vLLM): an embedding engine
    (a sentence-transformers encoder, mean pooling; a causal LM with task='embed', last-token
    pooling) starts and embeds with a plugin that does not import; a generating engine on
    the same model refuses naming it."""
    from tests.models.embedding_models import build_bert, st_embed

    folder = str(tmp_path / "st")
    st = build_bert(tiny_tokenizer, folder, "mean")
    install(tmp_path / "site", monkeypatch, {"broken": "no_such_module_lp_e:Thing"})
    text = "the quick brown fox"
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=64)
    got = llm.embed([text], use_tqdm=False)[0].outputs.embedding
    ref = st_embed(st, [text])[0]
    assert max(abs(a - float(b)) for a, b in zip(got, ref, strict=True)) < 2e-5
    emb = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
              task="embed")
    assert emb.engine.config.model_config.logits_processor_plugins == []
    ids = emb.get_tokenizer().encode(text, return_tensors="pt")
    with torch.no_grad():
        hidden = tiny_llama.hf_model.model(input_ids=ids).last_hidden_state[0, -1]
    want = torch.nn.functional.normalize(hidden, dim=0)
    got = torch.tensor(emb.embed(text, use_tqdm=False)[0].outputs.embedding)
    assert torch.allclose(got, want, atol=2e-5)
    with pytest.raises(ValueError, match="^logits processor plugin 'broken' = "
                                         "'no_such_module_lp_e:Thing'"):
        LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64)
