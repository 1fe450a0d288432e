"""``--pooler-config`` applied: the model folder's pooling with the overrides
:func:`kvflow.config.pooler_config.parse_pooler_config` checked (the fields and what each does
are listed there)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvflow.config.pooler_config import FLAG, SEQ_TYPES
from kvflow.models.pooling_config import PoolerConfig


def apply_pooler_overrides(config: PoolerConfig, overrides: dict[str, Any] | None,
                           hidden_size: int) -> PoolerConfig:
    """``config`` (the model's pooling) with ``overrides`` (:func:`parse_pooler_config`'s
    dict) applied.

    Args:
        config: the pooling the model folder gives.
        overrides: the checked fields, or None (``config`` as it is).
        hidden_size: the model's hidden size (the largest ``dimensions``).

    Raises:
        ValueError: naming the flag, for a sequence pooling type on a token classifier (it
            pools every token), ``dimensions`` the model does not support (Matryoshka) or
            on a model that does not embed, or ``logit_mean`` / ``logit_sigma`` on one with
            no classification head.
    """
    if not overrides:
        return config
    changes: dict[str, Any] = {}
    seq = overrides.get("seq_pooling_type", overrides.get("pooling_type"))
    if seq in SEQ_TYPES:
        if config.pooling_type == "all":
            raise ValueError(f"{FLAG}: {'seq_' if 'seq_pooling_type' in overrides else ''}"
                             f"pooling_type={seq!r} on a token classifier, which pools every "
                             "token (task token_classify): nothing would read it")
        changes["pooling_type"] = SEQ_TYPES[seq]
    head = config.task in ("score", "classify", "token_classify")
    if "use_activation" in overrides:
        changes["use_activation" if head else "normalize"] = overrides["use_activation"]
    if "dimensions" in overrides:
        if config.task != "embed":
            raise ValueError(f"{FLAG}: dimensions applies to embedding models; this engine "
                             f"runs task={config.task!r}")
        try:
            config.check_dimensions(overrides["dimensions"], hidden_size)
        except ValueError as e:
            raise ValueError(f"{FLAG}: {e}") from None
        changes["dimensions"] = overrides["dimensions"]
    for name in ("logit_mean", "logit_sigma"):
        if name in overrides:
            if not head:
                raise ValueError(f"{FLAG}: {name} calibrates a classification head's logits; "
                                 f"this engine runs task={config.task!r}")
            changes[name] = float(overrides[name])
    return dataclasses.replace(config, **changes)
