"""Several EOS ids (generation_config.json's ``eos_token_id`` list, as Llama 3 Instruct ships):
any of them ends generation, as in transformers' ``generate``. The tiny Llama's tokenizer EOS
is 0; the extra EOS id is a token its greedy continuation emits, so the oracle (transformers'
greedy ``generate`` with the same EOS list) stops there and kvflow must too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.models.generation_config import load_eos_token_ids
from kvflow.models.model_resolver import ModelSource

PROMPT = "the quick brown fox jumps"
N = 16
SERVER_ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64", "--block-size",
               "4", "--served-model-name", "m"]


def _ids(tiny_llama) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama.path).encode(PROMPT)


def _hf_greedy(tiny_llama, ids: list[int], eos: list[int] | None) -> list[int]:
    with torch.no_grad():
        out = tiny_llama.hf_model.generate(torch.tensor([ids]), do_sample=False,
                                           max_new_tokens=N, eos_token_id=eos, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _eos_model(tiny_llama, built_models) -> tuple[str, int, list[int]]:
    def build(folder: str) -> tuple[int, list[int]]:
        full = _hf_greedy(tiny_llama, _ids(tiny_llama), None)
        # the latest first occurrence of a token other than the tokenizer's EOS (0)
        k = max(i for i in range(N) if full[i] != 0 and full[i] not in full[:i])
        shutil.copytree(tiny_llama.path, folder)
        (Path(folder) / "generation_config.json").write_text(
            json.dumps({"eos_token_id": [0, full[k]]}))
        return full[k], full

    folder, (extra, full) = built_models("eos_list", build)
    return folder, extra, full


def prestart_servers(fixture):
    """This module's servers, taken with ``start_server.declared`` and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    return [(_eos_model(fixture("tiny_llama"), fixture("built_models"))[0], SERVER_ARGS,
             None)]


@pytest.fixture(scope="module")
def eos_model(tiny_llama, built_models) -> tuple[str, int, list[int]]:
    """(folder whose generation_config.json lists [0, extra], extra, transformers' greedy
    continuation with EOS ignored)."""
    return _eos_model(tiny_llama, built_models)


def test_load_eos_token_ids(tmp_path):
    folder = Path(tmp_path)
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    source = ModelSource("hf", str(folder), "m")
    assert load_eos_token_ids(source) == [7, 9]  # no generation_config.json: config.json's
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4, 3]}))
    assert load_eos_token_ids(source) == [3, 4]  # the file wins; repeats dropped
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_eos_token_ids(source) == [5]
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.5}))
    assert load_eos_token_ids(source, type("C", (), {"eos_token_id": 2})()) == [2]
    with pytest.raises(FileNotFoundError):  # a GGUF's ids come from its metadata (see
        load_eos_token_ids(ModelSource("gguf", str(folder / "m.gguf"), "m"))  # test_gguf_eos)


def test_every_eos_id_stops_generation(eos_model, tiny_llama):
    folder, extra, full = eos_model
    ids = _ids(tiny_llama)
    expected = _hf_greedy(tiny_llama, ids, [0, extra])
    assert expected[-1] == extra and 2 <= len(expected) < N  # the oracle stops there
    llm = LLM(model=folder, dtype="float32", num_kv_blocks=64, block_size=4)
    stop, ignore, plain = llm.generate(
        [PROMPT, PROMPT, PROMPT],
        [SamplingParams(temperature=0, max_tokens=N),
         SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
         SamplingParams(temperature=0, max_tokens=N, stop_token_ids=[extra])], use_tqdm=False)
    out = stop.outputs[0]
    assert out.token_ids == expected
    assert (out.finish_reason, out.stop_reason) == ("stop", extra)
    assert ignore.outputs[0].token_ids == full  # ignore_eos: none of them stops it
    assert plain.outputs[0].token_ids == expected  # the user's own stop id is kept once
    # min_tokens masks every EOS id until then, as it masks stop_token_ids
    (late,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N,
                                                  min_tokens=len(expected)), use_tqdm=False)
    assert extra not in late.outputs[0].token_ids[:len(expected)]


def test_server_stops_on_every_eos_id(eos_model, tiny_llama, start_server, request):
    _, extra, _ = eos_model
    expected = _hf_greedy(tiny_llama, _ids(tiny_llama), [0, extra])
    server = start_server.declared(request)
    try:
        reply = server.client().completions.create(
            model="m", prompt=PROMPT, max_tokens=N, temperature=0,
            extra_body={"return_token_ids": True})
    finally:
        server.terminate()
    choice = reply.choices[0]
    assert choice.token_ids == expected
    assert (choice.finish_reason, choice.stop_reason) == ("stop", extra)


@pytest.mark.parametrize("value", ["</s>", "0", [0, "7"], 2.0, True, [0, None], [[0]]],
                         ids=["token_string", "digit_string", "list_with_string", "float",
                              "bool", "list_with_null", "nested_list"])
def test_eos_id_that_is_not_an_integer_is_refused(tmp_path, value):
    """transformers' ``generate`` fails on such a value (TypeError) and vLLM stops on no token
    for it; it used to be dropped silently, config.json's ids standing in."""
    folder = Path(tmp_path)
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    path = folder / "generation_config.json"
    path.write_text(json.dumps({"eos_token_id": value}))
    with pytest.raises(ValueError) as info:
        load_eos_token_ids(ModelSource("hf", str(folder), "m"))
    assert str(info.value).startswith(f"{str(path)!r}: eos_token_id must be a token id (an "
                                      f"integer) or a list of token ids, not {value!r}")
    path.write_text(json.dumps({"eos_token_id": None}))  # null is unset: config.json's
    assert load_eos_token_ids(ModelSource("hf", str(folder), "m")) == [2]


def test_eos_id_that_is_not_an_integer_fails_before_the_weights_load(tiny_llama, tmp_path,
                                                                      monkeypatch):
    from kvflow.models import safetensors_files

    folder = shutil.copytree(tiny_llama.path, tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, "</s>"]}))
    monkeypatch.setattr(safetensors_files, "iter_safetensors_file",
                        lambda *a, **k: pytest.fail("weights read"))
    with pytest.raises(ValueError, match=r"generation_config.json': eos_token_id must be a "
                                         r"token id .* not \[0, '</s>'\] \('</s>' is not"):
        LLM(model=str(folder), dtype="float32", num_kv_blocks=64, block_size=4)


def test_eos_id_outside_the_vocabulary_is_kept_and_named(eos_model, tiny_llama, tmp_path,
                                                         caplog):
    """An id >= vocab_size is loaded as transformers and vLLM load it: no token can be it, so
    it stops nothing, and the file's other ids still stop generation (oracle: transformers'
    greedy ``generate`` with the same list); it used to be dropped without a word."""
    import logging

    _, extra, _ = eos_model
    big = tiny_llama.vocab_size + 5
    folder = shutil.copytree(tiny_llama.path, tmp_path / "m")
    path = folder / "generation_config.json"
    path.write_text(json.dumps({"eos_token_id": [0, big, extra]}))
    expected = _hf_greedy(tiny_llama, _ids(tiny_llama), [0, big, extra])
    assert expected[-1] == extra and len(expected) < N
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64, block_size=4)
    warnings = [r.getMessage() for r in caplog.records if "eos_token_id" in r.getMessage()]
    assert warnings == [(f"{str(path)!r}: eos_token_id {big} is not a token id of the model "
                        f"(vocab_size {tiny_llama.vocab_size}): no generated token can be it, "
                        "so it never ends generation (transformers and vLLM load it the same "
                        "way)")]
    (out,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N), use_tqdm=False)
    assert out.outputs[0].token_ids == expected
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", extra)


def test_server_refuses_it_before_the_cores_load(tiny_llama, tmp_path, monkeypatch):
    """``AsyncLLM`` (the server) reads the EOS ids while the core processes wait, gated."""
    from kvflow.config import EngineConfig
    from kvflow.engine import async_llm

    folder = shutil.copytree(tiny_llama.path, tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    monkeypatch.setattr(async_llm.ReplicaSet, "start", lambda self, gated=False: None)
    monkeypatch.setattr(async_llm.ReplicaSet, "release", lambda self: pytest.fail("released"))
    with pytest.raises(ValueError, match="generation_config.json': eos_token_id must be"):
        async_llm.AsyncLLM(EngineConfig.from_kwargs(model=str(folder), dtype="float32",
                                                    device="cpu"))
