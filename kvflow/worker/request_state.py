"""What a model runner keeps of each request it computes (:class:`RequestState`), from its
first step until it finishes, and what is derived from it once: the token ids that stop it
and its sampling seed. The per-step rows live in :mod:`kvflow.worker.input_batch`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvflow.inputs.multimodal import MultiModalFeature
from kvflow.lora.request import LoRARequest
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams


@dataclass
class RequestState:
    """What a runner keeps of a request from its first step until it finishes (across
    preemptions, which drop its row and generated tokens).

    Attributes:
        seed: its sampling seed (seeded random sampling, ``request_seed``), else None.
        mm_features: the prompt's images (vision-language models), else None.
        mrope_positions / mrope_delta: M-RoPE models: the prompt's position ids int64
            [3, prompt_len] and the offset of generated tokens' positions (None / 0 when the
            prompt has no image: plain positions on all three axes).
        lora_request: its LoRA adapter, else None; ``lora`` the loaded adapter (the runner's
            copy, kept while the request lives even if the adapter is removed meanwhile).
        pooling_params: set for an embedding request.
        prompt_embeds: a prompt given as embeddings: its rows [prompt_len, hidden] (cast to
            the model's dtype on first use; the prompt ids are placeholders), else None.
        draft_kv_tokens: a draft model's ``num_draft_computed`` when the request was last
            preempted (positions whose draft K/V its blocks held); restored when it is
            swapped back in (``--preemption-mode swap`` copies the draft's K/V too).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    seed: int | None = None
    mm_features: list[MultiModalFeature] | None = None
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0
    lora_request: LoRARequest | None = None
    lora: object | None = None
    pooling_params: PoolingParams | None = None
    prompt_embeds: torch.Tensor | None = None
    draft_kv_tokens: int = 0


def request_stop_ids(state: RequestState) -> list[int]:
    """The token ids that end the request: its ``stop_token_ids`` (the front end adds the
    model's further EOS ids from generation_config.json to them) and its EOS unless
    ``ignore_eos``, the ids ``core/sched_stops.check_stop`` finishes it on (as
    ``Request.stop_eos_id`` and ``stop_token_ids``)."""
    p = state.sampling_params
    stop = list(p.stop_token_ids)
    if state.eos_token_id is not None and not p.ignore_eos:
        stop.append(state.eos_token_id)
    return stop


def request_seed(params: SamplingParams) -> int | None:
    """A request's sampling seed when it samples seeded (its output token ``p`` is drawn with
    the numbers of ``(seed, p)``: ``layers/seeded_noise.py``), else None (greedy or
    unseeded)."""
    if params.seed is None or params.temperature == 0:
        return None
    return params.seed
