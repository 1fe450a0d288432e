"""``prompt_logprobs`` in vLLM's response form, shared by /v1/completions (per choice) and
/v1/chat/completions (on the reply)."""

from __future__ import annotations

from kvflow.entrypoints.protocol import PromptLogprob
from kvflow.entrypoints.serving_base import MIN_LOGPROB
from kvflow.outputs import Logprob


def vllm_prompt_logprobs(entries: list[dict[int, Logprob] | None] | None
                         ) -> list[dict[str, PromptLogprob] | None]:
    """One entry per prompt token: None for the first (nothing precedes it), else token id
    (as a string) -> its logprob (clamped to ``MIN_LOGPROB``: JSON has no -inf), rank and
    decoded text, for the prompt's own token and the top-k (``prompt_logprobs``)."""
    return [None if step is None else
            {str(tid): PromptLogprob(logprob=max(lp.logprob, MIN_LOGPROB), rank=lp.rank,
                                     decoded_token=lp.decoded_token)
             for tid, lp in step.items()}
            for step in entries or []]


def cut_prompt_logprobs(entries: list[dict[int, Logprob] | None] | None, ids: list[int],
                        num_logprobs: int) -> list[dict[int, Logprob] | None] | None:
    """Each prompt token's entry cut to its ``num_logprobs`` most likely alternatives (rank
    ``<= num_logprobs``) and the prompt's own token ``ids[p]``: the engine computed one k for
    two lists that ask for their own (/v1/completions with ``echo`` + ``logprobs`` and
    ``prompt_logprobs``: it runs the larger)."""
    if entries is None:
        return None
    return [None if step is None else
            {tid: lp for tid, lp in step.items() if lp.rank <= num_logprobs or tid == own}
            for own, step in zip(ids, entries)]
