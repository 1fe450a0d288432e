"""A draft model must share the target's tokenizer: checked at start-up, before any weight loads.

The draft proposes token ids and the target verifies them as its own ids. A draft whose
tokenizer maps ids to other tokens proposes ids that mean something else to the target:
verification still keeps the output exact (kvflow/spec_decode/rejection_sampler.py), but
nearly every draft is rejected, so speculation costs draft passes and saves nothing, in
silence. Equal vocabulary *sizes* (``DraftModel`` refuses unequal ones) do not catch it: two
byte-level BPE vocabularies of 32,000 tokens trained on different text share the size and
little else.

The check compares the two tokenizers as transformers loads them: the token of every id below
the smaller tokenizer's length (the shared range; a draft may add tokens past it, e.g. special
tokens of its own, which the target never sees), then the ids of each side's BOS and EOS
tokens in the other's vocabulary (they may sit past the shared range). When one side has no
tokenizer to load, nothing can be compared: a warning says so and the engine starts.
"""

from __future__ import annotations

import logging
from typing import Any

from kvflow.config import EngineConfig
from kvflow.models.loader import load_tokenizer
from kvflow.models.model_resolver import ModelSource, resolve_model

logger = logging.getLogger(__name__)


def check_draft_tokenizer(config: EngineConfig, target_source: ModelSource,
                          target_tokenizer: Any | None) -> None:
    """Refuse a ``draft_model`` whose tokenizer maps ids to other tokens than the target's.

    Args:
        config: the engine config; nothing is checked unless ``speculative_config`` has
            ``method='draft_model'``.
        target_source: the target model (its own tokenizer is loaded for the comparison when
            ``target_tokenizer`` is None, i.e. ``skip_tokenizer_init``).
        target_tokenizer: the tokenizer the engine uses for the target (``--tokenizer`` or the
            model's own), or None.

    Raises:
        ValueError: naming both models and the first difference: an id whose token differs,
            or a BOS/EOS token at another id; or when the draft model cannot be resolved.

    Logs a warning (and returns) when either side has no tokenizer that loads.
    """
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return
    mc = config.model_config
    try:
        draft_source = resolve_model(spec.model, mc.download_dir, token=mc.hf_token)
    except ValueError as e:
        raise ValueError(f"speculative_config model {spec.model!r}: {e}") from None
    target_name = mc.tokenizer or mc.model
    if target_tokenizer is None:
        target_tokenizer = _load_or_warn(target_source, f"the target {target_name!r}")
    draft_tokenizer = _load_or_warn(draft_source, f"the draft {spec.model!r}")
    if target_tokenizer is None or draft_tokenizer is None:
        return
    difference = first_tokenizer_difference(target_tokenizer, draft_tokenizer)
    if difference is not None:
        raise ValueError(
            f"speculative_config model {spec.model!r} has another tokenizer than the target "
            f"{target_name!r}: {difference}; a draft model must share the target's tokenizer "
            "(its token ids would mean other tokens to the target, which would reject nearly "
            "every draft)")


def _load_or_warn(source: ModelSource, which: str) -> Any | None:
    """``source``'s tokenizer, or None with a warning that the draft's tokenizer cannot be
    compared (``which`` names the side without one)."""
    try:
        return load_tokenizer(source)
    except ValueError as e:
        logger.warning("speculative_config: %s has no tokenizer to load (%s), so the draft "
                       "model's vocabulary is not compared with the target's; a draft with "
                       "another vocabulary would be accepted rarely", which, e)
        return None


def first_tokenizer_difference(target: Any, draft: Any) -> str | None:
    """The first way ``draft``'s token ids mean something else than ``target``'s (two
    transformers tokenizers), said in words, or None when they agree: an id below
    ``min(len(target), len(draft))`` whose token differs (the lowest such id), else a BOS or
    EOS token of either side that the other has at another id. A special token the other side
    lacks altogether is no difference (it lies past the shared range)."""
    target_tokens, draft_tokens = _tokens_by_id(target), _tokens_by_id(draft)
    for token_id in range(min(len(target), len(draft))):
        t, d = target_tokens.get(token_id), draft_tokens.get(token_id)
        if t != d:
            return f"id {token_id} is {t!r} in the target's vocabulary, {d!r} in the draft's"
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    for role in ("bos", "eos"):
        for side, tok, own, other in (("target", target, target_vocab, draft_vocab),
                                      ("draft", draft, draft_vocab, target_vocab)):
            token = getattr(tok, f"{role}_token", None)
            if token is None or token not in other or other[token] == own.get(token):
                continue
            t_id, d_id = (own[token], other[token]) if side == "target" \
                else (other[token], own[token])
            return (f"the {side}'s {role.upper()} token {token!r} is id {t_id} in the "
                    f"target's vocabulary, {d_id} in the draft's")
    return None


def _tokens_by_id(tokenizer: Any) -> dict[int, str]:
    """id -> token of a transformers tokenizer's whole vocabulary (added tokens included)."""
    return {token_id: token for token, token_id in tokenizer.get_vocab().items()}
