"""The offline API's arguments of the wrong type or shape (``LLM`` methods, ``SamplingParams``,
the argument checks of ``kvflow.offline.arguments``): each is refused with a ValueError naming the
argument, what it got and what is accepted (before, some said less, or raised a TypeError /
AttributeError from deep inside, or were accepted wrongly), what vLLM takes is taken, and the
LLM keeps working after a refusal."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow import LLM, PoolingParams, RequestOutput, SamplingParams
from kvflow.inputs.embeds import check_prompt_embeds
from kvflow.inputs.score import score_use_activation
from kvflow.inputs.truncation import truncation_length
from kvflow.offline.arguments import broadcast_params, broadcast_pooling_params, check_users

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm(tiny_chat_model):
    """The tiny Llama with its tiny chat template."""
    return LLM(model=tiny_chat_model, dtype="float32", device="cpu", num_kv_blocks=32,
               block_size=4, max_model_len=24)


def _tokens(llm: LLM, prompt, params: SamplingParams = GREEDY) -> list[int]:
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return out.outputs[0].token_ids


@pytest.mark.parametrize("prompts,got", [
    (5, "got int"), (None, "got NoneType"), (b"hi", "got bytes"),
    (np.array([3, 4]), (r"got ndarray \(token ids in an array or tensor: pass "
                        r"prompts.tolist\(\)\)")),
])
def test_prompts_of_another_type_name_every_accepted_form(llm, prompts, got, assert_no_leaks):
    """Said 'a string, a list of token ids, or a list of either': the dict prompts
    (TextPrompt / TokensPrompt / EmbedsPrompt, multimodal ones) were left out."""
    with pytest.raises(ValueError, match=r"prompts must be a string, a list of token ids, a "
                                         r"dict prompt \(TextPrompt .*TokensPrompt .*"
                                         r"EmbedsPrompt .*multi_modal_data.*\), or a list of "
                                         r"these; " + got):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert len(_tokens(llm, [3, 4])) == 3
    assert_no_leaks(llm)


@pytest.mark.parametrize("messages,match", [
    ("Hi", (r"chat\(\) messages must be a conversation \(a list of message dicts .*\) or a "
            r"list of conversations; got a string \('Hi'\): pass \[\{'role': 'user', "
            r"'content': <the text>\}\], or the text to generate\(\)")),
    (HI[0], r"got one message dict: wrap it in a list"),
    ([], r"got an empty list"),
    (None, r"got NoneType"),
    (["Hi"], (r"chat\(\) messages\[0\] must be a conversation \(a list of message dicts\) "
              r"or a message dict, got str")),
    ([HI, "Hi"], r"messages\[1\] must be a conversation .*got str"),
])
def test_chat_messages_of_another_shape_say_what_they_got(llm, messages, match):
    """``llm.chat("Hi")`` said only 'needs a non-empty list of messages'; ``["Hi"]`` 'a
    conversation must be a non-empty list of messages'. enqueue_chat refuses alike."""
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=match):
        llm.enqueue_chat(messages, GREEDY)
    assert not llm.engine.has_unfinished_requests() and llm.wait_for_completion() == []


def test_chat_takes_tuples_as_lists(llm):
    """A tuple of messages (or of conversations) was refused; it renders as the list."""
    (want,) = llm.chat(HI, GREEDY, use_tqdm=False)
    for messages in (tuple(HI), (HI,), [tuple(HI)]):
        (out,) = llm.chat(messages, GREEDY, use_tqdm=False)
        assert out.prompt == want.prompt == "<user>hi\n<assistant>"
        assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_chat_takes_plain_string_content_parts(llm):
    """A content part given as a plain string was 'content part 0 of type None is not
    supported'; vLLM's chat parser takes it as a text part, and so does kvflow."""
    def chat(content):
        (out,) = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
        return out.prompt, out.outputs[0].token_ids

    assert chat(["hi"]) == chat("hi") == chat([{"type": "text", "text": "hi"}])
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    assert chat(["h", "i"]) == chat([parts[0], "i"]) == chat(parts)
    assert chat(parts)[0] == "<user>h\ni\n<assistant>"  # parts joined by a newline
    with pytest.raises(ValueError, match="message 0: content part 0 of type None is not "
                                         "supported"):
        llm.chat([{"role": "user", "content": [5]}], GREEDY, use_tqdm=False)


def test_wait_for_completion_bad_output_type_keeps_the_queue(llm):
    """``output_type=5`` raised isinstance's TypeError after the queue was emptied: the
    enqueued requests' outputs were lost. Now a ValueError before anything runs, and the
    queue is still there."""
    ids = llm.enqueue([[3, 4], [5, 6]], GREEDY)
    for bad in (5, (RequestOutput, "x"), ()):
        with pytest.raises(ValueError, match=r"wait_for_completion\(output_type=.*\) must be "
                                             r"a class \(e.g. RequestOutput\), a tuple of "
                                             r"classes, or None"):
            llm.wait_for_completion(bad)
    outs = llm.wait_for_completion((RequestOutput,), use_tqdm=False)
    assert [o.request_id for o in outs] == ids
    assert [o.outputs[0].token_ids for o in outs] == [_tokens(llm, [3, 4]), _tokens(llm, [5, 6])]


@pytest.mark.parametrize("user", [5, 2.5, object()])
def test_user_that_is_no_list_is_named(llm, user):
    """``user=5`` raised "TypeError: 'int' object is not iterable"."""
    with pytest.raises(ValueError, match=r"user must be a list of 1 strings \(one per "
                                         r"prompt\), got "):
        llm.generate([[3]], GREEDY, use_tqdm=False, user=user)
    with pytest.raises(ValueError, match="user must be a list of 2 strings"):
        check_users(5, 2, "fair")
    assert check_users(("a", "b"), 2, "fair") == ["a", "b"]


def test_params_lists_name_the_bad_item():
    """A list holding something else said 'got list'; now its index and type."""
    with pytest.raises(ValueError, match=r"sampling_params\[1\] must be a SamplingParams, "
                                         r"got NoneType"):
        broadcast_params([GREEDY, None], 2)
    with pytest.raises(ValueError, match=r"sampling_params must be a SamplingParams, a list "
                                         r"of them \(one per prompt\) or None, got int"):
        broadcast_params(5, 2)
    with pytest.raises(ValueError, match=r"pooling_params\[0\] must be a PoolingParams, got "
                                         r"SamplingParams"):
        broadcast_pooling_params([GREEDY], 1)
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        broadcast_params([GREEDY], 2)


@pytest.mark.parametrize("value", ["3", 2.0, True, [3]])
def test_truncate_prompt_tokens_of_another_type(value):
    """``LLM.embed`` / ``LLM.score``'s ``truncate_prompt_tokens="3"`` raised "'<' not
    supported between 'str' and 'int'", and True was taken as 1."""
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens=.* is invalid: it must be "
                                         r"an integer >= 1, -1 \(max_model_len\) or None"):
        truncation_length(value, 24)
    assert truncation_length(3, 24) == 3 and truncation_length(-1, 24) == 24


def test_score_pooling_params_of_another_type():
    """``LLM.score(..., pooling_params=5)`` raised "AttributeError: 'int' object has no
    attribute 'task'"."""
    with pytest.raises(ValueError, match="pooling_params must be a PoolingParams or None, "
                                         "got int"):
        score_use_activation(5)
    assert score_use_activation(PoolingParams(use_activation=False)) is False


def test_structured_choice_string_is_refused():
    """``choice="ab"`` was taken as the choices 'a' and 'b' (a string is iterable)."""
    with pytest.raises(ValueError, match=r"structured_outputs.choice must be a non-empty list "
                                         r"of non-empty strings, got the string 'ab': wrap "
                                         r"it in a list"):
        SamplingParams(structured_outputs={"choice": "ab"})
    assert SamplingParams(structured_outputs={"choice": ("ab",)}).structured_outputs.choice


def test_numpy_numbers_are_taken_as_python_numbers(llm):
    """``temperature=np.float32(0.5)`` was 'not a number' and ``n=np.int64(2)`` 'not an
    integer' (vLLM takes both); they are stored as Python numbers, so the request is the
    same as with Python's."""
    plain = SamplingParams(n=2, temperature=0.5, top_k=5, seed=7, max_tokens=3,
                           stop_token_ids=[9], logit_bias={4: 2.0}, ignore_eos=True)
    numpy = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), top_k=np.int32(5),
                           seed=np.int64(7), max_tokens=np.int64(3),
                           stop_token_ids=[np.int64(9)], logit_bias={np.int64(4): np.float32(2)},
                           ignore_eos=True)
    assert numpy == plain
    assert type(numpy.n) is int and type(numpy.temperature) is float
    assert type(numpy.stop_token_ids[0]) is int
    (a,), (b,) = (llm.generate([[3, 4]], p, use_tqdm=False) for p in (plain, numpy))
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    for bad in (np.bool_(True), True):
        with pytest.raises(ValueError, match=r"SamplingParams.n=.*True.* it must be an integer"):
            SamplingParams(n=bad)


def test_meta_tensor_prompt_embeds_are_refused():
    """A meta tensor (shape, no values) raised torch's NotImplementedError 'Cannot copy out
    of meta tensor' from inside the check."""
    with pytest.raises(ValueError, match=r"prompt_embeds is a meta tensor \(a shape without "
                                         r"values\): pass the embeddings themselves"):
        check_prompt_embeds(torch.empty(3, 64, device="meta"), 64, 24)
    packed = check_prompt_embeds(torch.ones(3, 64), 64, 24)
    assert torch.equal(packed.tensor(), torch.ones(3, 64))
