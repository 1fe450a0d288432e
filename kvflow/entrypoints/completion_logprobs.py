"""Legacy /v1/completions logprobs (OpenAI's ``tokens`` / ``token_logprobs`` /
``top_logprobs`` / ``text_offset`` lists): the generated tokens', the echoed prompt's, and
the two joined."""

from __future__ import annotations

from typing import Any

from kvflow.entrypoints.prompt_logprobs import cut_prompt_logprobs
from kvflow.entrypoints.protocol import CompletionLogProbs
from kvflow.entrypoints.serving_base import MIN_LOGPROB
from kvflow.entrypoints.text_offsets import TokenTextOffsets
from kvflow.outputs import Logprob, RequestOutput


def prompt_logprobs_legacy(tokenizer: Any, ids: list[int], out: RequestOutput, echo: str,
                          as_token_ids: bool = False, num_logprobs: int | None = None
                          ) -> CompletionLogProbs:
    """The echoed prompt's logprobs (OpenAI legacy form: the first token has none); the
    offsets index ``echo``, the echoed text (``echo_offsets``); ``as_token_ids``: tokens as
    ``token_id:{id}`` (``completion_logprobs``); ``num_logprobs``: each token's
    alternatives cut to that many (the request's ``logprobs``; the engine may have computed
    more for ``prompt_logprobs``)."""
    entries = out.prompt_logprobs or [None] * len(ids)
    if num_logprobs is not None:
        entries = cut_prompt_logprobs(entries, ids, num_logprobs)
    lp = CompletionLogProbs()
    for token_id, step, offset in zip(ids, entries, echo_offsets(tokenizer, ids, echo)):
        if step is None:
            lp.tokens.append(f"token_id:{token_id}" if as_token_ids
                             else tokenizer.decode([token_id]))
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
            lp.text_offset.append(offset)
            continue
        one = completion_logprobs([token_id], [step], [offset], as_token_ids)
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(lp, name).extend(getattr(one, name))
    return lp


def echo_offsets(tokenizer: Any, ids: list[int], echo: str) -> list[int]:
    """Where each prompt token's text starts in ``echo`` (units: ``str`` characters), the
    echoed prompt: the prompt's own text when it came as text, else ``tokenizer.decode(ids)``.

    The offsets are counted in the ids' decode with special tokens kept. A text prompt's
    ids also hold the special tokens the tokenizer added (Llama's and Gemma's BOS), whose
    text its echo lacks: where that decode ends with the echo (else holds it), the text
    before the echo is taken off every offset, so a BOS and the prompt's first token both
    start at 0 (not at ``len("<s>")``). Every offset is capped at ``len(echo)``.
    """
    decoded = tokenizer.decode(ids) if tokenizer is not None else echo
    # not found (a decode that rewrites the text): the decode's offsets, capped
    shift = len(decoded) - len(echo) if decoded.endswith(echo) else max(decoded.find(echo), 0)
    offsets = TokenTextOffsets(tokenizer, 0, skip_special_tokens=False).next_offsets(ids)
    return [min(max(offset - shift, 0), len(echo)) for offset in offsets]


def with_prompt(prompt: CompletionLogProbs, completion: CompletionLogProbs
                 ) -> CompletionLogProbs:
    """The echoed prompt's logprobs followed by the completion's (offsets already count the
    echoed text, which comes first)."""
    out = CompletionLogProbs()
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(out, name).extend(getattr(prompt, name) + getattr(completion, name))
    return out


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]],
                        text_offsets: list[int], as_token_ids: bool = False
                        ) -> CompletionLogProbs:
    """Legacy-completions logprobs for some tokens, ``text_offsets`` (one per token, from
    ``TokenTextOffsets``) as their ``text_offset``.

    ``top_logprobs`` maps decoded token -> logprob for the top-k tokens and the sampled one.
    ``as_token_ids`` (vLLM's ``return_tokens_as_token_ids``): every token, in ``tokens`` and
    as a ``top_logprobs`` key, is written ``"token_id:{id}"`` instead of its text.
    """
    def name(tid: int, lp: Logprob) -> str:
        return f"token_id:{tid}" if as_token_ids else lp.decoded_token or ""

    out = CompletionLogProbs()
    for token_id, step, text_offset in zip(token_ids, logprobs, text_offsets):
        sampled = step[token_id]
        out.tokens.append(name(token_id, sampled))
        out.token_logprobs.append(max(sampled.logprob, MIN_LOGPROB))
        top: dict[str, float] = {}
        for tid, lp in sorted(step.items(), key=lambda item: item[1].rank):  # tokens
            top.setdefault(name(tid, lp), max(lp.logprob, MIN_LOGPROB))  # decoding alike: best
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
    return out
