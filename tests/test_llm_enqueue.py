"""vLLM 0.32's ``LLM.enqueue`` / ``enqueue_chat`` / ``wait_for_completion`` and
``get_default_sampling_params`` on the tiny Llama, against transformers (a plain greedy loop,
with the OpenAI presence / frequency penalties applied by hand where generation_config.json
sets them).

- enqueued prompts run only in ``wait_for_completion``, which returns them in the order queued
  with the tokens transformers gives;
- a ``generate`` between ``enqueue`` and ``wait_for_completion`` returns its own outputs only
  (``on_output`` sees only them) and runs the enqueued ones too, whose outputs wait;
- ``enqueue_chat`` renders as ``chat`` does (the output's ``prompt`` is the rendered text);
- ``get_default_sampling_params`` is the generation_config.json's fields, the penalties
  included (vLLM 0.32 reads them; kvflow read neither before), and requests without
  SamplingParams sample with them.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.outputs import EmbeddingRequestOutput, RequestOutput

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PROMPTS = [[5, 9, 13, 17, 21, 25], [40, 41, 42], [7, 70, 100, 130]]


def hf_greedy(hf_model, ids: list[int], n: int, presence: float = 0.0,
              frequency: float = 0.0) -> list[int]:
    """transformers' model decoded greedily by hand (EOS does not stop it), each step's
    logits less ``presence`` for a token already generated and ``frequency`` times its
    count (OpenAI's penalties, over the generated tokens only)."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = hf_model(torch.tensor([ids + out])).logits[0, -1].double()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long),
                                    minlength=logits.numel()).double()
            logits -= presence * (counts > 0) + frequency * counts
            out.append(int(logits.argmax()))
    return out


@pytest.fixture(scope="module")
def llm(tiny_chat_model):
    return LLM(model=tiny_chat_model, dtype="float32", num_kv_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return [hf_greedy(tiny_llama.hf_model, ids, GREEDY.max_tokens) for ids in PROMPTS]


def test_enqueue_runs_nothing_until_wait_for_completion(llm, expected, assert_no_leaks):
    ids = llm.enqueue(PROMPTS, GREEDY)
    assert len(ids) == 3 and len(set(ids)) == 3
    assert llm.engine.has_unfinished_requests()  # queued, not run
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == ids
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert all(isinstance(o, RequestOutput) and o.finished for o in outs)
    assert llm.wait_for_completion(use_tqdm=False) == []  # the queue is empty after it
    assert_no_leaks(llm)


def test_two_enqueues_come_back_together_in_queue_order(llm, expected):
    first = llm.enqueue(PROMPTS[2], GREEDY)
    second = llm.enqueue(PROMPTS[:2], [GREEDY, GREEDY], priority=0)
    outs = llm.wait_for_completion(RequestOutput, use_tqdm=False)
    assert [o.request_id for o in outs] == first + second
    assert [o.outputs[0].token_ids for o in outs] == [expected[2], *expected[:2]]


def test_generate_in_between_keeps_the_enqueued_outputs(llm, expected):
    ids = llm.enqueue(PROMPTS[:2], GREEDY)
    seen = []
    (out,) = llm.generate(PROMPTS[2], GREEDY, use_tqdm=False,
                          on_output=lambda i, o: seen.append((i, o.request_id)))
    assert out.outputs[0].token_ids == expected[2]
    assert {rid for _, rid in seen} == {out.request_id} and {i for i, _ in seen} == {0}
    assert not llm.engine.has_unfinished_requests()  # generate ran the enqueued ones too
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == ids
    assert [o.outputs[0].token_ids for o in outs] == expected[:2]


def test_enqueue_chat_renders_as_chat(llm, tiny_chat_model):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "the lazy dog"}]
    (ref,) = llm.chat(messages, GREEDY, use_tqdm=False)
    ids = llm.enqueue_chat([messages, messages], GREEDY, chat_template_content_format="string")
    outs = llm.wait_for_completion(use_tqdm=False)
    text = AutoTokenizer.from_pretrained(tiny_chat_model).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert [o.request_id for o in outs] == ids
    assert [o.prompt for o in outs] == [text, text] == [ref.prompt] * 2
    assert all(o.outputs[0].token_ids == ref.outputs[0].token_ids for o in outs)
    assert all(o.prompt_token_ids == ref.prompt_token_ids for o in outs)


def test_refusals_queue_nothing(llm):
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.enqueue(PROMPTS, [GREEDY])  # one params for three prompts
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.enqueue_chat([{"role": "user", "content": "x"}],
                         chat_template_content_format="markdown")
    assert not llm.engine.has_unfinished_requests()
    assert llm.wait_for_completion(use_tqdm=False) == []


def test_wait_for_completion_checks_the_output_type(llm):
    llm.enqueue(PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="EmbeddingRequestOutput.*RequestOutput"):
        llm.wait_for_completion(EmbeddingRequestOutput, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_default_sampling_params_from_generation_config(tiny_llama, tmp_path):
    """generation_config.json (hand-written) with vLLM 0.32's fields; a request without
    SamplingParams decodes greedily with its penalties, as the hand-penalized loop does."""
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama.path, folder)
    values = {"temperature": 0.0, "presence_penalty": 1.5, "frequency_penalty": 0.75,
              "max_new_tokens": 7, "top_p": 0.9, "do_sample": True}
    (folder / "generation_config.json").write_text(json.dumps(values))
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64, block_size=4)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.presence_penalty, defaults.frequency_penalty,
            defaults.max_tokens, defaults.top_p) == (0.0, 1.5, 0.75, 7, 0.9)
    assert defaults.top_k == SamplingParams().top_k and defaults.fields_set == {
        "temperature", "presence_penalty", "frequency_penalty", "max_tokens", "top_p"}
    assert llm.get_default_sampling_params() is not defaults
    ids = [30, 31, 32, 30, 31]
    want = hf_greedy(tiny_llama.hf_model, ids, 7, presence=1.5, frequency=0.75)
    assert want != hf_greedy(tiny_llama.hf_model, ids, 7)  # the penalties change it
    (out,) = llm.generate([ids], SamplingParams(ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == want
    plain = LLM(model=str(folder), dtype="float32", num_kv_blocks=64, block_size=4,
                generation_config="none")
    assert plain.get_default_sampling_params().fields_set == set()


@pytest.fixture
def refused_params(llm):
    """SamplingParams the engine core refuses once the grammar compiled: letters-only
    ``allowed_token_ids`` for a JSON object, which starts with ``{`` or whitespace."""
    from kvflow.structured import StructuredOutputsParams

    tokenizer = llm.get_tokenizer()
    letters = [i for i in range(len(tokenizer)) if tokenizer.decode([i]).isalpha()]
    return SamplingParams(max_tokens=4, allowed_token_ids=letters,
                          structured_outputs=StructuredOutputsParams(json={"type": "object"}))


def test_a_refused_enqueued_request_is_named(llm, refused_params, expected, assert_no_leaks):
    from kvflow.engine.streams import RequestRefused

    ids = llm.enqueue(PROMPTS[:2], [GREEDY, refused_params])
    with pytest.raises(RequestRefused, match=rf"^request {ids[1]}: SamplingParams\.allowed_"):
        llm.wait_for_completion(use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.wait_for_completion(use_tqdm=False) == []
    assert_no_leaks(llm)
    # refused while generate steps: generate's own output comes back, wait names the refusal
    ids = llm.enqueue(PROMPTS[:2], [refused_params, GREEDY])
    (out,) = llm.generate(PROMPTS[2], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == expected[2]
    with pytest.raises(RequestRefused, match=rf"^request {ids[0]}: "):
        llm.wait_for_completion(use_tqdm=False)
    assert llm.wait_for_completion(use_tqdm=False) == []
    assert_no_leaks(llm)
