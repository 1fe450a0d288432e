"""OutputProcessor in delta mode (streaming): per sample, the deltas add up to exactly what
cumulative mode reports (text, token ids, logprobs, finish), only changed samples appear, and
outputs that arrive after a stop string ended a sample are ignored."""

from __future__ import annotations

from kvflow.engine.output_processor import OutputProcessor
from kvflow.engine_outputs import EngineCoreOutput
from kvflow.inputs.processor import InputProcessor
from kvflow.sampling_params import SamplingParams

PROMPT = [5, 6, 7]


def _outputs(token_ids: list[int], sample_ids: list[str], finish_at: int | None = None):
    """One engine step per token: sample j gets token_ids[(step + j) % len]."""
    steps = []
    for step in range(len(token_ids)):
        finished = finish_at is not None and step == finish_at
        steps.append([EngineCoreOutput(
            sid, [token_ids[(step + j) % len(token_ids)]],
            [([1, 2], [-0.5, -1.5], -0.7, 3)], "length" if finished else None)
            for j, sid in enumerate(sample_ids)])
    return steps


def _run(tokenizer, params: SamplingParams, token_ids: list[int], delta: bool):
    processor = InputProcessor(tokenizer, 128, len(tokenizer), tokenizer.eos_token_id)
    requests = processor.make_requests("r", PROMPT, params)
    out_proc = OutputProcessor(tokenizer)
    out_proc.add_request(None, requests, delta=delta)
    results, aborted = [], []
    for step in _outputs(token_ids, [r.request_id for r in requests], len(token_ids) - 1):
        outs, stopped = out_proc.process(step)
        results.extend(outs)
        aborted.extend(stopped)
    return results, aborted


def test_deltas_add_up_to_the_cumulative_output(tiny_tokenizer):
    token_ids = tiny_tokenizer.encode("the quick brown fox jumps over a lazy dog")
    params = SamplingParams(n=2, logprobs=1, max_tokens=len(token_ids))
    cumulative, _ = _run(tiny_tokenizer, params, token_ids, delta=False)
    deltas, _ = _run(tiny_tokenizer, params, token_ids, delta=True)
    final = cumulative[-1]
    assert final.finished and deltas[-1].finished
    for index in (0, 1):
        pieces = [c for d in deltas for c in d.outputs if c.index == index]
        whole = final.outputs[index]
        assert "".join(c.text for c in pieces) == whole.text
        assert [t for c in pieces for t in c.token_ids] == whole.token_ids
        assert [lp for c in pieces for lp in c.logprobs] == whole.logprobs
        assert pieces[-1].finish_reason == whole.finish_reason == "length"
        assert all(c.finish_reason is None for c in pieces[:-1])


def test_stop_string_ends_a_sample_and_later_tokens_are_ignored(tiny_tokenizer):
    """Sample 1 sees the stream shifted by one token, so it stops one step before sample 0;
    the outputs it still gets (its abort is in flight) change nothing."""
    token_ids = tiny_tokenizer.encode("the quick brown fox jumps over")
    params = SamplingParams(n=2, stop=["brown"], max_tokens=len(token_ids))
    deltas, aborted = _run(tiny_tokenizer, params, token_ids, delta=True)
    assert sorted(aborted) == ["r-0", "r-1"]  # each once: the caller frees their KV blocks
    for index in (0, 1):
        pieces = [c for d in deltas for c in d.outputs if c.index == index]
        stream = token_ids[index:] + token_ids[:index]
        text = "".join(c.text for c in pieces)
        assert text == tiny_tokenizer.decode(stream).split("brown")[0]
        generated = [t for c in pieces for t in c.token_ids]
        assert generated == stream[:len(generated)]
        assert "brown" in tiny_tokenizer.decode(generated)
        assert "brown" not in tiny_tokenizer.decode(generated[:-1])
        assert (pieces[-1].finish_reason, pieces[-1].stop_reason) == ("stop", "brown")
    assert deltas[-1].finished
