"""A draft model whose tokenizer maps ids to other tokens than the target's is refused at
start-up (kvflow/spec_decode/draft_tokenizer.py). A draft of the same vocabulary *size* but
another vocabulary used to start in silence: verification kept the output exact, but its
drafts meant other tokens to the target and were nearly all rejected. Unequal sizes were (and
are) refused by ``DraftModel``; a draft without a tokenizer starts with a warning that nothing
could be compared.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.spec_decode.draft_tokenizer import first_tokenizer_difference

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def _spec(draft: str) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
            "adaptive": False, "quantization": "none"}


def _llm(target: str, draft: str) -> LLM:
    return LLM(model=target, dtype="float32", block_size=4, num_kv_blocks=64,
               speculative_config=_spec(draft))


def _swapped_copy(path: str, folder: str, a: int, b: int) -> str:
    """``path`` (weights and all) copied to ``folder`` with the BPE vocabulary's ids ``a`` and
    ``b`` swapped in tokenizer.json: the same size, two ids meaning other tokens."""
    shutil.copytree(path, folder)
    tokenizer_json = os.path.join(folder, "tokenizer.json")
    with open(tokenizer_json, encoding="utf-8") as f:
        data = json.load(f)
    vocab = data["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    vocab[by_id[a]], vocab[by_id[b]] = b, a
    with open(tokenizer_json, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return folder


def test_a_same_size_other_vocabulary_is_refused_naming_the_first_id(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    draft = _swapped_copy(tiny_llama.path, str(tmp_path / "swapped"), 100, 101)
    ours, theirs = AutoTokenizer.from_pretrained(tiny_llama.path), \
        AutoTokenizer.from_pretrained(draft)
    assert len(ours) == len(theirs)  # the sizes agree: only the ids differ
    t100, d100 = ours.convert_ids_to_tokens(100), theirs.convert_ids_to_tokens(100)
    assert t100 != d100
    with pytest.raises(ValueError) as e:
        _llm(tiny_llama.path, draft)
    assert str(e.value) == (
        f"speculative_config model {draft!r} has another tokenizer than the target "
        f"{tiny_llama.path!r}: id 100 is {t100!r} in the target's vocabulary, {d100!r} in the "
        "draft's; a draft model must share the target's tokenizer (its token ids would mean "
        "other tokens to the target, which would reject nearly every draft)")


def test_a_different_vocabulary_size_is_refused(tiny_llama, tmp_path):
    """The draft's config.json says 8 more tokens than the target's: refused by the size check
    (the tokenizers are the same)."""
    draft = str(tmp_path / "bigger")
    shutil.copytree(tiny_llama.path, draft)
    with open(os.path.join(draft, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["vocab_size"] = tiny_llama.vocab_size + 8
    with open(os.path.join(draft, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=rf"speculative_config model '{draft}' has a vocabulary "
                                         rf"of {tiny_llama.vocab_size + 8} tokens, the target "
                                         rf"{tiny_llama.vocab_size}"):
        _llm(tiny_llama.path, draft)


def test_a_draft_without_a_tokenizer_warns_and_runs(tiny_llama, tmp_path, caplog,
                                                    assert_no_leaks):
    """The target's own weights as the draft, its tokenizer files removed: nothing to compare,
    a warning naming the draft, and greedy output is transformers' greedy output."""
    draft = str(tmp_path / "no_tokenizer")
    shutil.copytree(tiny_llama.path, draft)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(draft, name)):
            os.remove(os.path.join(draft, name))
    assert not any(n.startswith(("tokenizer", "vocab")) for n in os.listdir(draft))
    with caplog.at_level(logging.WARNING, logger="kvflow.spec_decode.draft_tokenizer"):
        llm = _llm(tiny_llama.path, draft)
    assert f"speculative_config: the draft {draft!r} has no tokenizer to load" in caplog.text
    assert "vocabulary is not compared with the target's" in caplog.text
    prompt = [5, 17, 42, 99, 7, 23]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                   ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        ref = tiny_llama.hf_model.generate(torch.tensor([prompt]), max_new_tokens=12,
                                           min_new_tokens=12, do_sample=False)
    assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
    assert out.metrics.num_draft_tokens > 0
    assert_no_leaks(llm)


def _word_level(vocab: dict[str, int], eos: str):
    """A transformers tokenizer over a word-level ``vocab`` (ids may leave gaps)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)


def test_an_eos_token_past_the_shared_range_at_another_id_differs():
    """Ids 0..2 agree; the EOS token sits past them (a gap in the ids), at 5 in the target and
    6 in the draft."""
    target = _word_level({"a": 0, "b": 1, "c": 2, "<eos>": 5}, "<eos>")
    draft = _word_level({"a": 0, "b": 1, "c": 2, "<eos>": 6}, "<eos>")
    assert first_tokenizer_difference(target, target) is None
    assert first_tokenizer_difference(target, draft) == (
        "the target's EOS token '<eos>' is id 5 in the target's vocabulary, 6 in the draft's")
    # a longer draft (an extra token of its own past the shared range) is no difference
    longer = _word_level({"a": 0, "b": 1, "c": 2, "<eos>": 5, "<tool>": 9}, "<eos>")
    assert first_tokenizer_difference(target, longer) is None


def test_serve_refuses_it_in_one_line(tiny_llama, tmp_path, capfd):
    """``kvflow serve`` (AsyncLLM, the core in its own process) checks it too: exit status 2
    and the message, no traceback."""
    from kvflow.entrypoints.cli import main

    draft = _swapped_copy(tiny_llama.path, str(tmp_path / "swapped"), 200, 7)
    rc = main(["serve", tiny_llama.path, "--num-kv-blocks", "64", "--port", "0",
               "--speculative-config", json.dumps(_spec(draft))])
    err = capfd.readouterr().err
    assert rc == 2, err
    assert f"kvflow: error: speculative_config model {draft!r} has another tokenizer than " \
           f"the target {tiny_llama.path!r}: id 7 is " in err
    assert "Traceback" not in err
