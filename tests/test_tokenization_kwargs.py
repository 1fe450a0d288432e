"""``LLM.generate(..., tokenization_kwargs=...)``: vLLM's overrides for ``tokenizer.encode``.

Oracle: the HF tokenizer loaded as vLLM loads it for the runner (``truncation_side="left"``
for generation, ``"right"`` for pooling, whatever the tokenizer's config says) and called with
the same arguments (``tokenizer(prompt, **kwargs).input_ids``), the tokenizer's ids cut by hand
(the last ``k`` for generation: vLLM's ``TokenizeParams`` slices ``tokens[-k:]``), or padded by
hand where vLLM cuts after tokenizing (an explicit ``truncation_side``, token-id prompts,
padding); generation from the resulting ids against generation from those ids given directly.
"""

from __future__ import annotations

import shutil

import pytest

from kvflow import LLM, SamplingParams
from kvflow.inputs.tokenization import parse_tokenization_kwargs

TEXT = "Prefix caching reuses them, chunked prefill splits long prompts"
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def bos_model(tiny_llama, tmp_path_factory):
    """The tiny Llama with a tokenizer that adds ``<bos>`` (id 1) in front of every text
    and pads with ``<eos>``, so that special tokens and padding show in the ids: (the LLM,
    the HF tokenizer as saved, truncation_side "right", and as vLLM's generate runner loads
    it, truncation_side "left")."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok_kwargs") / "model"
    shutil.copytree(tiny_llama.path, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok.pad_token = "<eos>"
    tok.save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok(TEXT).input_ids[0] == 1 and tok.truncation_side == "right"
    llm = LLM(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=64,
              block_size=4, max_model_len=64)
    return llm, tok, AutoTokenizer.from_pretrained(folder, truncation_side="left")


def _ids(llm, prompt, kwargs):
    (out,) = llm.generate(prompt, GREEDY, use_tqdm=False, tokenization_kwargs=kwargs)
    return out


@pytest.mark.parametrize("kwargs", [
    {"add_special_tokens": False},
    {"truncation": True, "max_length": 6},
    {"truncation": "longest_first", "max_length": 5, "add_special_tokens": False},
])
def test_text_prompts_are_tokenized_as_the_tokenizer_with_the_same_kwargs(bos_model, kwargs):
    """The ids are the HF tokenizer's with the same arguments, loaded as vLLM's generate
    runner loads it (left truncation: the last tokens kept, the tokenizer's <bos> too), and
    generation from them equals generation from those ids given directly."""
    llm, tok, left = bos_model
    want = left(TEXT, **kwargs).input_ids
    assert want != tok(TEXT).input_ids
    out = _ids(llm, TEXT, kwargs)
    assert out.prompt_token_ids == want
    assert out.prompt == TEXT
    (direct,) = llm.generate(want, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids


def test_generation_keeps_the_last_tokens_as_vllm_does(bos_model):
    """Kept the FIRST tokens (the tokenizer's own right side) where vLLM's generate runner
    keeps the LAST: by hand, a text keeps its <bos> and the end of its text (HF's left
    truncation), a token-id prompt its last k ids, as SamplingParams.truncate_prompt_tokens
    keeps them."""
    llm, tok, _ = bos_model
    body = tok(TEXT, add_special_tokens=False).input_ids
    assert len(body) > 6 and tok(TEXT).input_ids == [1] + body
    assert _ids(llm, TEXT, {"truncate_prompt_tokens": 3}).prompt_token_ids == [1] + body[-2:]
    assert _ids(llm, TEXT, {"truncation": True, "max_length": 4}
                ).prompt_token_ids == [1] + body[-3:]
    assert _ids(llm, TEXT, {"truncate_prompt_tokens": 4, "add_special_tokens": False}
                ).prompt_token_ids == body[-4:]
    ids = tok(TEXT).input_ids
    sampled = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                             truncate_prompt_tokens=4)
    assert _ids(llm, ids, {"truncate_prompt_tokens": 4}).prompt_token_ids == ids[-4:] == \
        llm.generate(ids, sampled, use_tqdm=False)[0].prompt_token_ids


def test_cuts_on_an_explicit_side_padding_and_lower_case(bos_model):
    """truncation_side given: the whole tokenization cut on that side (vLLM slices after
    encoding, <bos> included); token-id prompts cut on the left (vLLM's generate side);
    padding="max_length" appends the pad token; do_lower_case lower-cases the text."""
    llm, tok, _ = bos_model
    ids = tok(TEXT).input_ids
    assert _ids(llm, TEXT, {"truncate_prompt_tokens": 5, "truncation_side": "left"}
                ).prompt_token_ids == ids[-5:]
    assert _ids(llm, TEXT, {"truncate_prompt_tokens": 5, "truncation_side": "right"}
                ).prompt_token_ids == ids[:5]
    assert _ids(llm, ids, {"truncation": True, "max_length": 4}).prompt_token_ids == ids[-4:]
    short = tok("the fox").input_ids
    assert _ids(llm, "the fox", {"padding": "max_length", "max_length": 8}
                ).prompt_token_ids == short + [tok.pad_token_id] * (8 - len(short))
    assert _ids(llm, "the fox", {"pad_prompt_tokens": 6}).prompt_token_ids == \
        short + [tok.pad_token_id] * (6 - len(short))
    assert _ids(llm, "THE Fox", {"do_lower_case": True}).prompt_token_ids == short
    assert _ids(llm, TEXT, {"truncation": False, "padding": False,
                            "needs_detokenization": True}).prompt_token_ids == ids


@pytest.mark.parametrize("kwargs,match", [
    ({"return_tensors": "pt"}, r"tokenization_kwargs \['return_tensors'\] are not read"),
    ({"truncation": "only_second"}, r"tokenization_kwargs\['truncation'\]='only_second'"),
    ({"padding": "longest"}, r"tokenization_kwargs\['padding'\]='longest'"),
    ({"truncation_side": "middle"}, r"tokenization_kwargs\['truncation_side'\]"),
    ({"max_length": 0}, r"tokenization_kwargs\['max_length'\]=0"),
    ({"max_length": 65}, r"\['max_length'\]=65 is greater than max_model_len \(64\)"),
    ({"add_special_tokens": "no"}, r"tokenization_kwargs\['add_special_tokens'\] must be"),
])
def test_other_keys_and_bad_values_are_refused_naming_them(bos_model, kwargs, match):
    """vLLM logs and ignores a key its renderer does not read; kvflow refuses it, naming it,
    and queues nothing."""
    llm, *_ = bos_model
    with pytest.raises(ValueError, match=match):
        llm.generate([TEXT, "the fox"], GREEDY, use_tqdm=False, tokenization_kwargs=kwargs)
    assert not llm.engine.has_unfinished_requests()


def test_minus_one_means_max_model_len_and_none_changes_nothing():
    assert parse_tokenization_kwargs(None, 64) is None
    assert parse_tokenization_kwargs({}, 64) is None
    assert parse_tokenization_kwargs({"truncate_prompt_tokens": -1}, 64).keep == 64
    assert parse_tokenization_kwargs({"truncation": True}, 64).keep == 64
    assert parse_tokenization_kwargs({"padding": "max_length", "max_length": 9}, 64).pad_to == 9


@pytest.mark.parametrize("side,keep,want", [
    ("left", 1, lambda b: [0]), ("left", 2, lambda b: [1, 0]),
    ("left", 4, lambda b: [1, *b[-2:], 0]), ("right", 1, lambda b: [1]),
    ("right", 4, lambda b: [1, *b[:2], 0]),
])
def test_a_text_is_cut_around_its_special_tokens(tiny_tokenizer, side, keep, want):
    """Without truncation_side, a text is cut as the HF tokenizer cuts it on the runner's
    side (its special tokens before and after kept, the text between cut; special tokens
    alone longer than k: the whole ids cut), as vLLM's renderer does (checked against vLLM
    0.32's TokenizeParams with its tokenizer loaded per runner). By hand, for a tokenizer
    writing ``<bos> text <eos>`` (ids 1 and 0)."""
    import copy

    from tokenizers import processors

    tok = copy.deepcopy(tiny_tokenizer)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 1), ("<eos>", 0)])
    body = tok(TEXT, add_special_tokens=False).input_ids
    assert tok(TEXT).input_ids == [1, *body, 0]
    options = parse_tokenization_kwargs({"truncate_prompt_tokens": keep}, 64,
                                        default_side=side)
    assert options.encode(tok, TEXT) == want(body)
    assert tok(TEXT).input_ids == [1, *body, 0]  # the tokenizer is left as it was


def test_chat_tokenizes_the_rendered_text_with_them(bos_model):
    """LLM.chat(tokenization_kwargs=...): the rendered conversation tokenized as the HF
    tokenizer does with the same kwargs, special tokens off unless they say (the template
    writes them); a cut keeps the conversation's end (its last turn, vLLM's left side), not
    its start as it did."""
    llm, tok, left = bos_model
    messages = [{"role": "user", "content": TEXT}]
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    plain, added, cut = (llm.chat(messages, GREEDY, use_tqdm=False, chat_template=template,
                                  tokenization_kwargs=kwargs)[0]
                         for kwargs in (None, {"add_special_tokens": True},
                                        {"truncation": True, "max_length": 5}))
    assert plain.prompt == added.prompt == cut.prompt == TEXT
    assert plain.prompt_token_ids == tok(TEXT, add_special_tokens=False).input_ids
    assert added.prompt_token_ids == tok(TEXT).input_ids
    assert cut.prompt_token_ids == tok(TEXT, add_special_tokens=False).input_ids[-5:] == \
        left(TEXT, add_special_tokens=False, truncation=True, max_length=5).input_ids


def test_embed_and_encode_take_them(tiny_tokenizer, tmp_path_factory):
    """LLM.embed / LLM.encode(tokenization_kwargs=...): the prompt ids are the HF
    tokenizer's with the same kwargs, loaded as vLLM's pooling runner loads it (right
    truncation: the first tokens kept, even where the tokenizer's config says "left", as
    this one does: kvflow cut on that side before), and the embedding is the one of those
    ids given directly."""
    import json

    import torch
    from transformers import AutoTokenizer

    from tests.models.embedding_models import build_bert

    folder = str(tmp_path_factory.mktemp("tok_kwargs_bert") / "st")
    build_bert(tiny_tokenizer, folder, "mean")
    config_path = f"{folder}/tokenizer_config.json"
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "truncation_side": "left"}, f)
    llm = LLM(model=folder, dtype="float32", device="cpu")
    tok = llm.get_tokenizer()
    assert tok.truncation_side == "left"
    kwargs = {"truncation": True, "max_length": 4}
    want = AutoTokenizer.from_pretrained(folder, truncation_side="right")(TEXT, **kwargs).input_ids
    assert want == tok(TEXT).input_ids[:4]
    (ids,) = llm.embed(tok(TEXT).input_ids, use_tqdm=False,
                       tokenization_kwargs={"truncate_prompt_tokens": 4})
    assert ids.prompt_token_ids == want
    (out,) = llm.embed(TEXT, use_tqdm=False, tokenization_kwargs=kwargs)
    (direct,) = llm.embed(want, use_tqdm=False)
    assert out.prompt_token_ids == want
    assert out.outputs.embedding == direct.outputs.embedding
    (encoded,) = llm.encode(TEXT, use_tqdm=False, tokenization_kwargs=kwargs)
    assert torch.equal(encoded.outputs.data, torch.tensor(direct.outputs.embedding))
    with pytest.raises(ValueError, match=r"tokenization_kwargs \['stride'\] are not read"):
        llm.embed(TEXT, use_tqdm=False, tokenization_kwargs={"stride": 2})
