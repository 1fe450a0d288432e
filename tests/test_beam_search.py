"""LLM.beam_search against a plain torch beam search over the transformers model's own
logits (the same algorithm, ``kvflow.beam_search``'s docstring), and against transformers'
``generate(num_beams=...)`` where the two algorithms agree (no EOS, every beam the same
length); bad parameters are refused naming the field."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvflow.beam_search import BeamSearchParams

# A candidate closer than this (nats) to the cut-off would let fp32 rounding on another CPU
# pick the other beam: the reference asserts every decision it makes is wider.
MARGIN = 1e-3
# fp32 logprobs of the engine and of transformers differ by ~1e-5 per token (architecture.md)
TOLERANCE = 1e-4


@dataclass
class Beam:
    tokens: list[int]
    cum_logprob: float
    eos: bool = False


def _logprobs(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


def _cut(values: list[float], k: int, what: str) -> None:
    """Assert the k-th and (k+1)-th of ``values`` (sorted descending) are MARGIN apart."""
    if len(values) > k:
        assert values[k - 1] - values[k] > MARGIN, f"near-tie at the {what} cut: {values}"


def reference_beam_search(hf_model, prompt: list[int], width: int, max_tokens: int,
                          eos: int | None, length_penalty: float) -> list[Beam]:
    """Beam search as the module docstring states it, over HF logits in fp32; asserts
    that no decision is within MARGIN of a tie. ``eos=None``: ignore EOS."""
    live, finished = [Beam(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        if not live:
            break
        candidates = []
        for beam in live:
            lp = _logprobs(hf_model, beam.tokens)
            top = torch.topk(lp, 2 * width + 1)
            if eos in top.indices[2 * width - 1:].tolist():  # the cut decides if EOS joins
                _cut(top.values.tolist(), 2 * width, "per-beam top-2k")
            for value, token in zip(top.values[:2 * width].tolist(),
                                    top.indices[:2 * width].tolist()):
                child = Beam(beam.tokens + [token], beam.cum_logprob + value, token == eos)
                (finished if child.eos else candidates).append(child)
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)
        _cut([b.cum_logprob for b in candidates], width, "live-beam")
        live = candidates[:width]

    def score(b: Beam) -> float:
        return b.cum_logprob / (len(b.tokens) - b.eos) ** length_penalty

    ranked = sorted(finished + live, key=score, reverse=True)
    _cut([score(b) for b in ranked], width, "final")
    return ranked[:width]


@pytest.fixture(scope="module")
def beam_llm(tiny_llama):
    from kvflow import LLM
    return LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=256,
               block_size=4)


def _check(out, prompt: list[int], ref: list[Beam]) -> None:
    assert [s.tokens for s in out.sequences] == [b.tokens for b in ref]
    for seq, beam in zip(out.sequences, ref):
        assert seq.cum_logprob == pytest.approx(beam.cum_logprob, abs=TOLERANCE)
        assert seq.finish_reason == ("stop" if beam.eos else "length")
        assert len(seq.logprobs) == len(seq.tokens) - len(prompt)
        generated = seq.tokens[len(prompt):]
        assert sum(step[t].logprob for step, t in zip(seq.logprobs, generated)) == \
            pytest.approx(seq.cum_logprob, abs=1e-6)


# (prompt, beam width, max_tokens, length_penalty); the first prompt's best beams end in EOS
EOS_PROMPT = [219, 319, 53, 135, 37, 115, 38, 156, 181, 225, 94]
CASES = [(EOS_PROMPT, 3, 8, 1.0), (EOS_PROMPT, 3, 8, 0.0), (EOS_PROMPT, 3, 8, 2.0),
         ([274, 310, 77, 160, 52, 39, 171], 3, 8, 1.0), ([43, 165, 262, 252], 1, 6, 1.0),
         ([140, 61, 114], 4, 5, 1.0)]


@pytest.mark.parametrize("prompt,width,max_tokens,length_penalty", CASES)
def test_beams_match_a_torch_reference(beam_llm, tiny_llama, prompt, width, max_tokens,
                                       length_penalty, assert_no_leaks):
    ref = reference_beam_search(tiny_llama.hf_model, prompt, width, max_tokens,
                                tiny_llama.eos_token_id, length_penalty)
    (out,) = beam_llm.beam_search([prompt], BeamSearchParams(
        width, max_tokens, length_penalty=length_penalty))
    _check(out, prompt, ref)
    assert_no_leaks(beam_llm)


def test_eos_beams_are_finished_and_ranked_by_length(beam_llm, tiny_llama):
    """The EOS prompt's returned beams include EOS-finished ones (the case above is not
    vacuous), and length_penalty changes the ranking as the score says."""
    ref = reference_beam_search(tiny_llama.hf_model, EOS_PROMPT, 3, 8,
                                tiny_llama.eos_token_id, 1.0)
    assert any(b.eos for b in ref) and not all(b.eos for b in ref)
    (out,) = beam_llm.beam_search(EOS_PROMPT, BeamSearchParams(3, 8))
    stopped = [s for s in out.sequences if s.finish_reason == "stop"]
    assert stopped and all(s.tokens[-1] == tiny_llama.eos_token_id for s in stopped)
    assert all(len(s.tokens) == len(EOS_PROMPT) + 8 for s in out.sequences
               if s.finish_reason == "length")
    tok = beam_llm.get_tokenizer()
    assert out.sequences[0].text == tok.decode(out.sequences[0].tokens[:-1]
                                               if out.sequences[0].finish_reason == "stop"
                                               else out.sequences[0].tokens,
                                               skip_special_tokens=True)


def test_a_batch_is_each_prompt_alone(beam_llm):
    prompts = [case[0] for case in CASES[3:]] + [EOS_PROMPT]
    params = BeamSearchParams(3, 5)
    together = beam_llm.beam_search(prompts, params)
    alone = [beam_llm.beam_search([p], params)[0] for p in prompts]
    for a, b in zip(together, alone):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.cum_logprob for s in a.sequences] == pytest.approx(
            [s.cum_logprob for s in b.sequences], abs=TOLERANCE)


def test_concurrency_limit_and_use_tqdm_are_vllms(beam_llm, tiny_llama, monkeypatch):
    """vLLM's ``beam_search(..., use_tqdm, concurrency_limit)`` (a TypeError before): with a
    limit of 2 the searches run two prompts at a time (no step holds more than 2 x width
    beams) and each result is the torch reference's; the tqdm factory counts every prompt;
    a limit of 0 is refused naming it. A salted prompt after the first chunk keeps its
    salt (the step requests' owners are offset by the chunk's start)."""
    prompts = [case[0] for case in CASES[3:]] + [EOS_PROMPT]
    width, max_tokens = 3, 5
    refs = [reference_beam_search(tiny_llama.hf_model, p, width, max_tokens,
                                  tiny_llama.eos_token_id, 1.0) for p in prompts]
    batches: list[int] = []
    generate = beam_llm.generate

    def counting(steps, *args, **kwargs):
        batches.append(len(steps))
        return generate(steps, *args, **kwargs)

    monkeypatch.setattr(beam_llm, "generate", counting)
    made = []

    def factory(**kwargs):
        from tqdm.auto import tqdm

        made.append(kwargs)
        return tqdm(disable=True, **kwargs)

    salted = [*prompts[:3], {"prompt_token_ids": prompts[3], "cache_salt": "eve"}]
    outs = beam_llm.beam_search(salted, BeamSearchParams(width, max_tokens),
                                use_tqdm=factory, concurrency_limit=2)
    for out, prompt, ref in zip(outs, prompts, refs):
        _check(out, prompt, ref)
    assert max(batches) <= 2 * width < max(len(prompts), 3) * width
    assert made == [{"total": 4, "desc": "Beam search"}]
    monkeypatch.undo()
    from kvflow import SamplingParams

    hits = beam_llm.generate([{"prompt_token_ids": prompts[3], "cache_salt": "eve"}],
                             SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert hits[0].metrics.num_cached_tokens > 0
    with pytest.raises(ValueError, match="concurrency_limit must be an integer >= 1"):
        beam_llm.beam_search(prompts, BeamSearchParams(2, 2), concurrency_limit=0)


@pytest.mark.parametrize("width", [2, 4])
def test_matches_transformers_generate_without_eos(beam_llm, tiny_llama, width):
    """With ignore_eos every beam has max_tokens tokens, so length_penalty=0 ranks by
    cumulative logprob in both algorithms, and transformers' top-2k over all beams' scores
    keeps the same beams as the per-beam top-2k (the global top-k is inside each beam's
    top-k). transformers is told no EOS exists, so it never finishes a beam early."""
    prompt, max_tokens = [274, 310, 77, 160, 52, 39, 171], 6
    reference_beam_search(tiny_llama.hf_model, prompt, width, max_tokens, None, 0.0)
    with torch.no_grad():
        hf = tiny_llama.hf_model.generate(
            torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
            do_sample=False, max_new_tokens=max_tokens, length_penalty=0.0,
            early_stopping=False, eos_token_id=None, pad_token_id=0,
            output_scores=True, return_dict_in_generate=True)
    (out,) = beam_llm.beam_search([prompt], BeamSearchParams(
        width, max_tokens, ignore_eos=True, length_penalty=0.0))
    assert [s.tokens for s in out.sequences] == hf.sequences.tolist()
    assert [s.cum_logprob for s in out.sequences] == pytest.approx(
        hf.sequences_scores.tolist(), abs=TOLERANCE)


@pytest.mark.parametrize("kwargs,field", [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
    ({"beam_width": 129, "max_tokens": 4}, "beam_width"),
    ({"beam_width": 2.0, "max_tokens": 4}, "beam_width"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
    ({"beam_width": 2, "max_tokens": 4, "temperature": 0.7}, "temperature"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
    ({"beam_width": 2, "max_tokens": 4, "ignore_eos": 1}, "ignore_eos"),
])
def test_bad_params_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"BeamSearchParams\.{field}="):
        BeamSearchParams(**kwargs)


def test_bad_prompts_are_refused_before_anything_runs(beam_llm, assert_no_leaks):
    with pytest.raises(ValueError, match="prompt 1 has 250 tokens"):
        beam_llm.beam_search([[5, 6], [7] * 250], BeamSearchParams(2, 8))
    with pytest.raises(ValueError, match="prompt 1: .*outside the vocabulary"):
        beam_llm.beam_search([[5, 6], [5, 6, 100000]], BeamSearchParams(2, 8))
    with pytest.raises(ValueError, match="prompt 2: the prompt is empty"):
        beam_llm.beam_search([[5, 6], "x", []], BeamSearchParams(2, 8))
    from kvflow import SamplingParams
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        beam_llm.beam_search([[5, 6]], SamplingParams())
    assert_no_leaks(beam_llm)


@pytest.mark.parametrize("skip", [True, False])
def test_include_stop_str_in_output_keeps_the_eos_text(beam_llm, tiny_llama, skip):
    """The EOS token's text ends a stopped beam's text only with include_stop_str_in_output,
    and, the EOS being a special token, only with skip_special_tokens=False (the text is the
    tokenizer's decode of the tokens with skip_special_tokens, as vLLM's beam search and a
    sampled request write it; the EOS text showed with skip_special_tokens too before);
    the beams and scores are the same either way."""
    plain, kept = (beam_llm.beam_search([EOS_PROMPT], BeamSearchParams(
        3, 8, include_stop_str_in_output=flag, skip_special_tokens=skip))[0]
        for flag in (False, True))
    assert [s.tokens for s in plain.sequences] == [s.tokens for s in kept.sequences]
    tok = beam_llm.get_tokenizer()
    eos = tiny_llama.eos_token_id
    assert eos in tok.all_special_ids
    assert any(a.finish_reason == "stop" for a in plain.sequences)
    for a, b in zip(plain.sequences, kept.sequences):
        assert b.text == tok.decode(a.tokens, skip_special_tokens=skip)
        if a.finish_reason == "stop":
            assert a.text == tok.decode(a.tokens[:-1], skip_special_tokens=skip)
            assert (b.text != a.text) == (not skip)
        else:
            assert b.text == a.text


def test_vllms_other_params_fields_are_taken(beam_llm, tiny_llama):
    """vLLM 0.32's BeamSearchParams also has skip_special_tokens, structured_outputs and
    watermarking (a TypeError here before): skip_special_tokens=False keeps the special
    tokens in each sequence's text (here the prompt's BOS; text = the tokenizer's decode of
    the tokens, a final EOS dropped), the beams unchanged; watermarking is taken and does
    nothing (vLLM's beam steps never watermark); structured_outputs is refused naming it."""
    tok = beam_llm.get_tokenizer()
    prompt = [tok.bos_token_id, *EOS_PROMPT]
    plain, kept = (beam_llm.beam_search([prompt], BeamSearchParams(
        3, 8, skip_special_tokens=flag, watermarking=flag))[0] for flag in (True, False))
    assert [s.tokens for s in plain.sequences] == [s.tokens for s in kept.sequences]
    for a, b in zip(plain.sequences, kept.sequences):
        tokens = a.tokens[:-1] if a.finish_reason == "stop" else a.tokens
        assert a.text == tok.decode(tokens, skip_special_tokens=True)
        assert b.text == tok.decode(tokens, skip_special_tokens=False) != a.text
        assert b.text.startswith(tok.bos_token)
    assert BeamSearchParams(2, 4, watermarking=None).watermarking is None
    with pytest.raises(ValueError, match=r"BeamSearchParams\.structured_outputs "):
        BeamSearchParams(2, 4, structured_outputs={"json": {"type": "object"}})
    for field in ("skip_special_tokens", "watermarking"):
        with pytest.raises(ValueError, match=rf"BeamSearchParams\.{field}=1 "):
            BeamSearchParams(2, 4, **{field: 1})


def test_a_final_eos_is_not_counted_under_ignore_eos_either():
    """vLLM's get_beam_search_score drops a last token equal to EOS from the length whatever
    ended the beam, so with ignore_eos a live beam ending in EOS is scored on one token
    fewer. Hand-computed, prompt of 3, one step, length_penalty 1: the EOS beam (-1.0) scores
    -1.0 / 3 = -0.333, the other (-1.2) -1.2 / 4 = -0.3, so the other ranks first (counting
    the EOS, -1.0 / 4 = -0.25 ranked the EOS beam first)."""
    from kvflow.beam_search import BeamSearch
    from kvflow.outputs import Logprob

    search = BeamSearch([5, 6, 7], BeamSearchParams(2, 1, ignore_eos=True), frozenset({0}))
    search.advance([{0: Logprob(-1.0, 1), 9: Logprob(-1.2, 2), 4: Logprob(-3.0, 3)}])
    assert [(b.tokens, b.finish_reason) for b in search.best()] == [
        ([5, 6, 7, 9], "length"), ([5, 6, 7, 0], "length")]
    # without ignore_eos the EOS beam is finished, and scored the same way
    search = BeamSearch([5, 6, 7], BeamSearchParams(2, 1), frozenset({0}))
    search.advance([{0: Logprob(-1.0, 1), 9: Logprob(-1.2, 2), 4: Logprob(-3.0, 3)}])
    assert [(b.tokens, b.finish_reason) for b in search.best()] == [
        ([5, 6, 7, 9], "length"), ([5, 6, 7, 0], "stop")]
