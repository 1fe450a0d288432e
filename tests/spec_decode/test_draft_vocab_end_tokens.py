"""FR-Spec keeps the *target's* end tokens in the draft's cut LM head, not only the draft's.

A base-model draft for an instruct target ends text with another token than the target (Qwen2.5:
``<|endoftext|>`` against ``<|im_end|>``). The cut head (``draft_vocab_size``) kept only the
draft's own ``eos_token_id``, so when the target's end tokens lay above the cut the draft could
never propose the end of an answer and the last draft window before it was always rejected.
Now the head keeps the target's declared EOS ids (generation_config.json's ``eos_token_id``, an
int or a list, else config.json's: ``load_eos_token_ids``, whose ids the engine stops on), and
each drafting request's own stop ids (its EOS, the tokenizer's when it has one, and its
``stop_token_ids``: what ``check_stop`` ends it on) are added like its context tokens. The
draft's own end tokens are read the same way (generation_config.json's, else config.json's),
not from its config.json alone.

The target here is the tiny Llama with its end tokens moved above the 48-id cut (its config,
generation_config.json or tokenizer edited); the draft is the unchanged tiny Llama (EOS id 0),
so it drafts the target's own argmax and the window that ends an answer is accepted only if the
end token is in the head. Greedy output is checked against transformers' ``generate`` told the
target's end tokens; the opposite direction (a draft whose end token the target does not stop
on) keeps the target's output too.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from kvflow import LLM, SamplingParams
from tests.spec_decode.test_draft_vocab import _spy_drafts
from tests.spec_decode.test_ngram_engine import _drafted

SUBSET = 48  # of the tiny tokenizer's 320 ids
PROMPT = [5, 17, 42, 9, 23, 31, 7]  # ids below the cut


def _engine(target: str, draft: str | None = None) -> LLM:
    spec = None if draft is None else {"method": "draft_model", "model": draft,
                                       "num_speculative_tokens": 3, "adaptive": False,
                                       "draft_vocab_size": SUBSET, "quantization": "none"}
    return LLM(model=target, dtype="float32", block_size=4, num_kv_blocks=96,
               speculative_config=spec)


def _edited_copy(path: str, folder: str, config_eos: int | list[int] | None = None,
                 generation_eos: int | list[int] | None = None,
                 tokenizer_eos: int | None = None, no_generation_config: bool = False) -> str:
    """The tiny model in ``path`` copied to ``folder`` with its end tokens edited: config.json's
    ``eos_token_id``, a generation_config.json ``eos_token_id`` (replacing the saved file), the
    tokenizer's EOS token (the token at that id); None leaves each as it is.
    ``no_generation_config``: the saved generation_config.json removed."""
    shutil.copytree(path, folder)
    if no_generation_config:
        os.remove(os.path.join(folder, "generation_config.json"))
    if config_eos is not None:
        config_file = os.path.join(folder, "config.json")
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
        config["eos_token_id"] = config_eos
        with open(config_file, "w", encoding="utf-8") as f:
            json.dump(config, f)
    if generation_eos is not None:
        with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump({"eos_token_id": generation_eos}, f)
    if tokenizer_eos is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(tokenizer_eos)
        tokenizer.save_pretrained(folder)
        assert AutoTokenizer.from_pretrained(folder).eos_token_id == tokenizer_eos
    return folder


@pytest.fixture(scope="module")
def greedy_ids(tiny_llama) -> list[int]:
    """The tiny Llama's greedy continuation of PROMPT (transformers, 30 tokens, no EOS)."""
    hf = tiny_llama.hf_model
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def _new_ids_above_cut(greedy: list[int]) -> list[int]:
    """Ids >= SUBSET of the greedy continuation at their first appearance, outside PROMPT (so
    neither the cut nor the context puts them in the draft's head before they appear)."""
    seen: list[int] = []
    for t in greedy:
        if t >= SUBSET and t not in PROMPT and t not in seen:
            seen.append(t)
    return seen


def _drafter(llm: LLM):
    return llm.engine.core.executor.runner.drafter


@pytest.mark.parametrize("generation_eos", [[300, 0, 310], 305], ids=["list", "int"])
def test_the_targets_declared_end_tokens_are_kept(tiny_llama, tmp_path, generation_eos):
    """Target: config.json eos 290 (read only without generation_config.json), a
    generation_config.json ``eos_token_id`` list or int; draft: the tiny Llama (eos 0). The
    fixed subset is ids 0-47, the draft's 0 and the target's generation_config ids."""
    target = _edited_copy(tiny_llama.path, str(tmp_path / "target"), config_eos=290,
                          generation_eos=generation_eos)
    vocab = _drafter(_engine(target, tiny_llama.path)).vocab
    declared = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    expected = sorted(set(range(SUBSET)) | {0} | set(declared))
    assert vocab.fixed_ids.tolist() == expected
    assert 290 not in vocab.fixed_ids  # generation_config.json's ids win, as the engine stops


def test_config_eos_is_kept_without_generation_config(tiny_llama, tmp_path):
    target = _edited_copy(tiny_llama.path, str(tmp_path / "target"), config_eos=290,
                          no_generation_config=True)
    assert not os.path.exists(os.path.join(target, "generation_config.json"))
    vocab = _drafter(_engine(target, tiny_llama.path)).vocab
    assert vocab.fixed_ids.tolist() == list(range(SUBSET)) + [290]


@pytest.mark.parametrize("generation_eos", [[0, 260, 270], 265], ids=["list", "int"])
def test_the_drafts_declared_end_tokens_are_kept(tiny_llama, tmp_path, generation_eos):
    """The draft's end tokens are read as the target's are (``load_eos_token_ids``): its
    generation_config.json ``eos_token_id`` (a list or an int) wins over its config.json's
    (290, not kept). Target: the tiny Llama (end token 0). The fixed subset is ids 0-47, the
    target's 0 and the draft's generation_config ids."""
    draft = _edited_copy(tiny_llama.path, str(tmp_path / "draft"), config_eos=290,
                         generation_eos=generation_eos)
    vocab = _drafter(_engine(tiny_llama.path, draft)).vocab
    expected = list(range(SUBSET)) + ([260, 270] if isinstance(generation_eos, list) else [265])
    assert vocab.fixed_ids.tolist() == expected
    assert 290 not in vocab.fixed_ids


def test_the_drafts_config_eos_is_kept_without_generation_config(tiny_llama, tmp_path):
    draft = _edited_copy(tiny_llama.path, str(tmp_path / "draft"), config_eos=[290, 300],
                         no_generation_config=True)
    vocab = _drafter(_engine(tiny_llama.path, draft)).vocab
    assert vocab.fixed_ids.tolist() == list(range(SUBSET)) + [290, 300]


def test_a_requests_stop_ids_join_the_head(tiny_llama, tmp_path):
    """The tokenizer's EOS (317, in neither config: the request's ``eos_token_id``) and a
    request's ``stop_token_ids`` (299) are not in the fixed subset but in the head's columns
    while the request drafts; a request with ``ignore_eos`` does not stop on 317, and 317 is
    not added for it."""
    target = _edited_copy(tiny_llama.path, str(tmp_path / "target"), tokenizer_eos=317)
    llm = _engine(target, tiny_llama.path)
    vocab = _drafter(llm).vocab
    assert vocab.fixed_ids.tolist() == list(range(SUBSET))  # config eos 0 = the draft's
    columns: list[set[int]] = []
    original = vocab.update

    def spy(*args, **kwargs):
        original(*args, **kwargs)
        columns.append(set(vocab.token_ids.tolist()))

    vocab.update = spy
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[299]),
                 use_tqdm=False)
    assert columns and all({317, 299} <= c for c in columns)
    columns.clear()
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    assert columns and all(317 not in c and 299 not in c for c in columns)


@pytest.mark.parametrize("where", ["generation_config", "tokenizer"])
def test_greedy_ends_where_the_target_does_and_the_draft_proposes_it(
        tiny_llama, tmp_path, greedy_ids, assert_no_leaks, where):
    """The target stops on E, an id above the cut that its greedy continuation reaches (the
    first such new id at position 10 or later, so the answer spans several draft windows),
    declared in generation_config.json (beside the tokenizer's EOS 0) or
    as the tokenizer's EOS (beside generation_config.json's 0: E reaches the draft only as the
    request's ``eos_token_id``). Output
    equals transformers' ``generate`` stopping on the target's end tokens, and the draft (the
    same weights, eos 0) proposes E: before, E was outside its head and never drafted."""
    end = next(t for t in _new_ids_above_cut(greedy_ids) if greedy_ids.index(t) >= 10)
    edits = {"generation_eos": [end]} if where == "generation_config" else \
        {"tokenizer_eos": end}  # generation_config.json's eos 0 stays: only requests carry E
    target = _edited_copy(tiny_llama.path, str(tmp_path / "target"), **edits)
    stop = greedy_ids.index(end) + 1
    with torch.no_grad():  # the oracle: transformers stopping on the target's end tokens
        ref = tiny_llama.hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=30,
                                           do_sample=False, eos_token_id=[0, end],
                                           pad_token_id=0)
    expected = ref[0, len(PROMPT):].tolist()
    assert expected == greedy_ids[:stop] and expected[-1] == end
    params = SamplingParams(temperature=0, max_tokens=30)
    plain = _engine(target).generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert list(plain.token_ids) == expected
    spec = _engine(target, tiny_llama.path)
    drafts = _spy_drafts(spec)
    got = spec.generate([PROMPT], params, use_tqdm=False)
    assert list(got[0].outputs[0].token_ids) == expected
    assert got[0].outputs[0].finish_reason == "stop"
    assert end in drafts
    drafted, accepted = _drafted(got)
    assert drafted > 0 and accepted > 0
    assert_no_leaks(spec)


def test_a_drafts_own_end_token_is_a_plain_token_to_the_target(
        tiny_llama, tmp_path, greedy_ids, assert_no_leaks):
    """The opposite direction: the draft's config says its EOS is X (no generation_config.json,
    whose ids would win), an id above the cut that the target generates mid-answer (not a stop
    for the target, whose EOS stays 0). X is in the draft's head, the draft proposes it, and
    the target takes it as an ordinary token and goes on: output equals transformers'
    ``generate`` (eos 0), all 30 tokens, X inside."""
    x = _new_ids_above_cut(greedy_ids)[0]
    draft = _edited_copy(tiny_llama.path, str(tmp_path / "draft"), config_eos=x,
                         no_generation_config=True)
    with torch.no_grad():
        ref = tiny_llama.hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=30,
                                           do_sample=False, eos_token_id=[0], pad_token_id=0)
    expected = ref[0, len(PROMPT):].tolist()
    assert x in expected[:-1]
    spec = _engine(tiny_llama.path, draft)
    assert x in _drafter(spec).vocab.fixed_ids
    drafts = _spy_drafts(spec)
    got = spec.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    assert list(got[0].outputs[0].token_ids) == expected
    assert x in drafts
    assert_no_leaks(spec)


def test_update_adds_stop_ids_and_skips_ids_outside_the_vocabulary():
    """A head of 100 ids cut to 0-6 plus the end token 99; the context adds 40, the drafting
    rows' stop ids add 50 and 77 (99 is already kept; -1 and 120 lie outside the vocabulary
    and are skipped, not an IndexError)."""
    import numpy as np

    from kvflow.layers.embedding import ParallelLMHead
    from kvflow.spec_decode.draft_vocab import DraftVocab

    head = ParallelLMHead(100, 16)
    head.weight.data.copy_(torch.randn(100, 16, generator=torch.Generator().manual_seed(0)))
    model = torch.nn.Module()
    model.lm_head = head
    vocab = DraftVocab(model, 7, always=[99])
    vocab.update(np.array([[3, 40, 5]]), np.array([3]), np.array([0]),
                 [[77, 99, -1, 120], (50,)])
    assert vocab.token_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 99, 40, 50, 77]
