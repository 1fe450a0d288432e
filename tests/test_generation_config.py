"""A model's generation_config.json sampling defaults (``--generation-config auto|none``) in
``LLM.generate``, ``LLM.chat`` and ``kvflow generate``, against transformers' greedy
``generate`` with the same repetition penalty; ``python -m kvflow`` with ``--config``.

The model is the tiny Llama plus ``{"temperature": 0.0, "repetition_penalty": 2.0,
"max_new_tokens": 6, "top_k": 5}`` in its generation_config.json (and a chat template).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.entrypoints.cli import main

GEN_DEFAULTS = {"temperature": 0.0, "repetition_penalty": 2.0, "max_new_tokens": 6, "top_k": 5}
PROMPT = "the quick brown fox jumps"
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def with_generation_config(source: str, folder: Path, values: dict) -> str:
    """A copy of the model folder whose generation_config.json also holds ``values``."""
    from transformers import AutoTokenizer

    shutil.copytree(source, folder)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, **values}))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def gen_model(tiny_llama, tmp_path_factory) -> str:
    return with_generation_config(tiny_llama.path, tmp_path_factory.mktemp("gen") / "m",
                                  GEN_DEFAULTS)


@pytest.fixture(scope="module")
def token_ids(tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama.path)
    return lambda text: tokenizer.encode(text)


def hf_greedy(tiny, ids: list[int], n: int, repetition_penalty: float = 1.0) -> list[int]:
    """transformers' greedy continuation (EOS does not stop it)."""
    with torch.no_grad():
        out = tiny.hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                                     repetition_penalty=repetition_penalty, eos_token_id=None,
                                     pad_token_id=0)
    return out[0, len(ids):].tolist()


def _llm(model: str, **kwargs) -> LLM:
    return LLM(model=model, dtype="float32", num_kv_blocks=64, block_size=4, **kwargs)


def test_model_defaults_fill_unset_fields(gen_model, tiny_llama, token_ids):
    ids = token_ids(PROMPT)
    expected = hf_greedy(tiny_llama, ids, 6, repetition_penalty=2.0)
    assert expected != hf_greedy(tiny_llama, ids, 6)  # the penalty changes this continuation
    llm = _llm(gen_model)
    assert llm.engine.sampling_defaults == {"temperature": 0.0, "repetition_penalty": 2.0,
                                            "max_tokens": 6, "top_k": 5}
    (out,) = llm.generate(PROMPT, SamplingParams(ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == expected
    (out,) = llm.generate([ids], None, use_tqdm=False)  # no SamplingParams: EOS may stop it
    got = out.outputs[0].token_ids
    assert got == expected[:len(got)]
    assert len(got) == 6 or got[-1] == tiny_llama.eos_token_id


def test_request_values_win_even_when_equal_to_the_dataclass_default(gen_model):
    """max_tokens=16, temperature=1.0, repetition_penalty=1.0 are SamplingParams' own defaults;
    set explicitly they beat the model's 6 / 0.0 / 2.0: the tokens equal a run that ignores
    the file."""
    params = SamplingParams(temperature=1.0, top_k=0, max_tokens=16, repetition_penalty=1.0,
                            seed=3, ignore_eos=True)
    (ours,) = _llm(gen_model).generate(PROMPT, params, use_tqdm=False)
    (plain,) = _llm(gen_model, generation_config="none").generate(PROMPT, params,
                                                                  use_tqdm=False)
    assert len(ours.outputs[0].token_ids) == 16
    assert ours.outputs[0].token_ids == plain.outputs[0].token_ids


def test_none_ignores_the_file(gen_model, tiny_llama, token_ids):
    llm = _llm(gen_model, generation_config="none")
    assert llm.engine.sampling_defaults == {}
    (out,) = llm.generate(PROMPT, SamplingParams(temperature=0, ignore_eos=True),
                          use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama, token_ids(PROMPT), 16)


def test_chat_uses_the_defaults(gen_model, tiny_llama):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "the lazy dog"}]
    text = AutoTokenizer.from_pretrained(gen_model).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    ids = AutoTokenizer.from_pretrained(gen_model).encode(text, add_special_tokens=False)
    (out,) = _llm(gen_model).chat(messages, SamplingParams(ignore_eos=True), use_tqdm=False)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama, ids, 6, repetition_penalty=2.0)


@pytest.mark.parametrize("values, field", [({"top_p": 0.0}, "top_p"),
                                           ({"max_new_tokens": 0}, "max_tokens"),
                                           ({"temperature": "hot"}, "temperature")])
def test_invalid_generation_config_is_one_clear_error(tiny_llama, tmp_path, values, field):
    model = with_generation_config(tiny_llama.path, tmp_path / "m", values)
    with pytest.raises(ValueError, match="generation_config.json") as info:
        _llm(model)
    message = str(info.value)
    assert field in message and "--generation-config none" in message and "\n" not in message
    assert _llm(model, generation_config="none").engine.sampling_defaults == {}


def test_cli_generate_uses_defaults_and_flags_win(gen_model, tiny_llama, token_ids, capsys):
    from transformers import AutoTokenizer

    decode = AutoTokenizer.from_pretrained(gen_model).decode
    ids = token_ids(PROMPT)
    base = ["generate", "--model", gen_model, "--prompt", PROMPT, "--dtype", "float32",
            "--num-kv-blocks", "64", "--ignore-eos"]
    assert main(base) == 0
    penalized = hf_greedy(tiny_llama, ids, 6, repetition_penalty=2.0)
    assert capsys.readouterr().out == PROMPT + decode(penalized, skip_special_tokens=True) + "\n"
    assert main([*base, "--max-tokens", "16", "--repetition-penalty", "1.0"]) == 0
    plain = hf_greedy(tiny_llama, ids, 16)
    assert capsys.readouterr().out == PROMPT + decode(plain, skip_special_tokens=True) + "\n"


def test_python_m_kvflow_with_a_config_file(gen_model, tiny_llama, token_ids, tmp_path,
                                            monkeypatch, capsys):
    """``python -m kvflow generate --config FILE`` as the kvflow script would run it (kvflow's
    ``__main__`` run by runpy with that command line, in this process: a fresh interpreter
    running ``python -m kvflow`` is tests/test_platform_plugins.py's): the file sets the
    model, flags and --generation-config none; a typed flag overrides the file."""
    import runpy

    from transformers import AutoTokenizer

    config = tmp_path / "engine.yaml"
    config.write_text(f"model: {gen_model}\ndtype: float32\nnum_kv_blocks: 64\n"
                      f"generation-config: none\ntemperature: 0\nmax-tokens: 9\n"
                      f"ignore_eos: true\nprompt: [{json.dumps(PROMPT)}]\n")
    monkeypatch.setattr(sys, "argv", ["kvflow", "generate", "--config", str(config),
                                      "--max-tokens", "5"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("kvflow", run_name="__main__", alter_sys=True)
    out = capsys.readouterr()
    assert done.value.code == 0, out.err
    expected = hf_greedy(tiny_llama, token_ids(PROMPT), 5)
    decode = AutoTokenizer.from_pretrained(gen_model).decode
    assert out.out == PROMPT + decode(expected, skip_special_tokens=True) + "\n"


def test_presence_and_frequency_penalties_are_read(tiny_llama, tmp_path):
    """vLLM 0.32 reads both penalties from generation_config.json (and takes them in
    ``override_generation_config``); kvflow read neither."""
    model = with_generation_config(tiny_llama.path, tmp_path / "m",
                                   {"presence_penalty": 0.5, "frequency_penalty": -0.25})
    assert _llm(model).engine.sampling_defaults == {"presence_penalty": 0.5,
                                                    "frequency_penalty": -0.25}
    llm = _llm(model, override_generation_config={"frequency_penalty": 1.0})
    assert llm.engine.sampling_defaults == {"presence_penalty": 0.5, "frequency_penalty": 1.0}
