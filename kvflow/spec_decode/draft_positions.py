"""How far a draft model can draft: the positions its rotary table covers.

A draft model reads its own config: its ``max_position_embeddings`` (scaled for YaRN /
dynamic NTK, as the target's is) may be shorter than the target's context, e.g. a 2k-token
draft for a 32k-token target. Its passes index the rotary table at every position they
compute, and it computes K/V only for requests that draft (it catches their context up
lazily): the speculator stops drafting for a request before the table's end
(``Speculator``'s ``draft_positions``), and the request decodes on without drafts, as vLLM
skips speculation for sequences longer than the draft's ``max_model_len``.

An EAGLE head reads every position the target computes, drafting or not, so it cannot stop
there: its table is extended to the target's instead (``head_loading.extend_head_positions``);
an MTP head is the target's own layer. Neither has a limit here.
"""

from __future__ import annotations

from kvflow.config import EngineConfig
from kvflow.layers.rope_parameters import rope_max_positions
from kvflow.models.loader import load_hf_config
from kvflow.models.model_resolver import resolve_model


def draft_positions(config: EngineConfig) -> int | None:
    """Positions a draft model's rotary table covers (None: no limit of its own, or no
    draft model: n-gram drafts, EAGLE and MTP heads).

    Raises:
        ValueError: for a draft that cannot be resolved or read (``speculative_config
            model NAME:`` and the reader's message).
    """
    spec, mc = config.speculative_config, config.model_config
    if spec is None or spec.method != "draft_model":
        return None
    try:
        source = resolve_model(spec.model, mc.download_dir, token=mc.hf_token)
        hf_config = load_hf_config(source, trust_remote_code=mc.trust_remote_code)
    except ValueError as e:
        raise ValueError(f"speculative_config model {spec.model!r}: {e}") from None
    if getattr(hf_config, "max_position_embeddings", None) is None:
        return None
    return rope_max_positions(hf_config)

