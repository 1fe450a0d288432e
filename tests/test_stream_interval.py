"""vLLM's ``--stream-interval N``: a streamed request's first token goes out at once, then its
new tokens every N tokens, and the finishing output at once (vLLM's
``RequestState.make_request_output``); the deltas still add up to the whole output. Checked on
``OutputProcessor`` fed one token per step (and three per step, as speculative decoding gives),
the expected token counts per output hand-computed; the flag reaches ``AsyncLLM``'s processor
through ``SchedulerConfig``."""

from __future__ import annotations

import pytest

from kvflow.config import EngineConfig
from kvflow.engine_outputs import EngineCoreOutput
from kvflow.entrypoints.cli import build_parser
from kvflow.input_processor import InputProcessor
from kvflow.output_processor import OutputProcessor
from kvflow.sampling_params import SamplingParams

PROMPT = [5, 6, 7]


def _stream(tokenizer, interval: int, tokens: int, per_step: int = 1, delta: bool = True,
            n: int = 1):
    """(per returned output: the tokens of sample 0 in it, whether finished); the whole
    text of sample 0 from the deltas, and the tokens fed."""
    token_ids = (tokenizer.encode("the quick brown fox jumps over a lazy dog") * 3)[:tokens]
    processor = InputProcessor(tokenizer, 128, len(tokenizer), tokenizer.eos_token_id)
    requests = processor.make_requests("r", PROMPT, SamplingParams(n=n, max_tokens=tokens))
    out_proc = OutputProcessor(tokenizer, stream_interval=interval)
    out_proc.add_request(None, requests, delta=delta)
    got, text = [], ""
    for start in range(0, tokens, per_step):
        chunk = token_ids[start:start + per_step]
        last = start + per_step >= tokens
        outs, _ = out_proc.process([EngineCoreOutput(r.request_id, chunk, None,
                                                     "length" if last else None)
                                    for r in requests])
        for out in outs:
            sample = next(c for c in out.outputs if c.index == 0)
            got.append((len(sample.token_ids), out.finished))
            text += sample.text
    return got, text, token_ids


@pytest.mark.parametrize("interval,tokens,per_step,expected", [
    (1, 4, 1, [1, 1, 1, 1]),
    (3, 10, 1, [1, 3, 3, 3]),  # first at once, then every 3; the 10th token ends it
    (4, 10, 1, [1, 4, 4, 1]),  # the last output is sent at once, short
    (5, 3, 1, [1, 2]),
    (4, 12, 3, [3, 6, 3]),  # 3 tokens a step: 3 sent, then 6 (>= 4), then the final 3
])
def test_outputs_held_to_the_interval(tiny_tokenizer, interval, tokens, per_step, expected):
    got, text, token_ids = _stream(tiny_tokenizer, interval, tokens, per_step)
    assert [count for count, _ in got] == expected
    assert [finished for _, finished in got] == [False] * (len(expected) - 1) + [True]
    assert text == tiny_tokenizer.decode(token_ids)


def test_cumulative_requests_get_every_step(tiny_tokenizer):
    got, _, _ = _stream(tiny_tokenizer, 4, 6, delta=False)
    assert [count for count, _ in got] == [1, 2, 3, 4, 5, 6]


def test_several_samples(tiny_tokenizer):
    got, _, _ = _stream(tiny_tokenizer, 3, 7, n=2)
    assert [count for count, _ in got] == [1, 3, 3]


def test_flag_reaches_the_config(tmp_path):
    args = build_parser().parse_args(["serve", "m", "--stream-interval", "8"])
    assert EngineConfig.from_cli_args(args).scheduler_config.stream_interval == 8
    assert EngineConfig.from_kwargs(stream_interval=2).scheduler_config.stream_interval == 2
    with pytest.raises(ValueError, match="stream_interval=0 must be >= 1"):
        EngineConfig.from_kwargs(stream_interval=0)
