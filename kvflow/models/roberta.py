"""RoBERTa and XLM-RoBERTa encoders for embeddings (``RobertaModel`` / ``XLMRobertaModel``:
sentence-transformers' all-distilroberta-v1, multilingual E5, BGE-M3, ...).

The same post-LayerNorm encoder as BERT (:mod:`kvflow.models.bert`; Liu et al. 2019 changed
the training, not the layers), with fairseq's position numbering: positions start at
``padding_idx + 1`` (``pad_token_id``, 1 in every released checkpoint), tokens equal to the
padding id take position ``padding_idx`` and are not counted (transformers'
``create_position_ids_from_input_ids``). So ``max_position_embeddings`` (514) covers
``max_position_embeddings - padding_idx - 1`` (512) tokens. One token type (type 0), as BERT.
Checkpoint names carry an optional ``roberta.`` prefix; the pooler and MLM head
(``lm_head.``) are skipped.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from kvflow.models.bert import BertEmbeddings, BertModel


def roberta_position_ids(input_ids: torch.Tensor, positions: torch.Tensor,
                         padding_idx: int) -> torch.Tensor:
    """fairseq / transformers position ids of whole sequences laid back to back.

    Args:
        input_ids: [T] token ids of the step's sequences.
        positions: [T] each token's index in its own sequence (0 at each sequence's start).
        padding_idx: the padding token id (``pad_token_id``).

    Returns:
        [T] int64: ``padding_idx + (non-padding tokens of the sequence up to and including this
        one)`` for a non-padding token, ``padding_idx`` for a padding one.
    """
    mask = input_ids.ne(padding_idx).long()
    counted = mask.cumsum(0)
    start = torch.arange(input_ids.shape[0], device=input_ids.device) - positions.long()
    in_sequence = counted - counted[start] + mask[start]
    return in_sequence * mask + padding_idx


class RobertaEmbeddings(BertEmbeddings):
    """BERT's embeddings with RoBERTa's position ids (:func:`roberta_position_ids`)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.padding_idx = int(config.pad_token_id)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``positions`` count from each sequence's start; one segment (RoBERTa has one token
        type: ``token_type_ids`` is None or zeros)."""
        return super().forward(input_ids,
                               roberta_position_ids(input_ids, positions, self.padding_idx),
                               token_type_ids)


class RobertaModel(BertModel):
    """``forward(input_ids [T], positions [T]) -> hidden [T, hidden_size]`` for whole
    sequences, as :class:`~kvflow.models.bert.BertModel`.

    Raises:
        ValueError: as BertModel's constructor, or when ``pad_token_id`` is unset (the
            position ids count from it).
    """

    embeddings_cls: ClassVar[type[nn.Module]] = RobertaEmbeddings
    checkpoint_prefix: ClassVar[str] = "roberta."
    skipped_prefixes: ClassVar[tuple[str, ...]] = ("pooler.", "lm_head.")

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(config, "pad_token_id", None) is None:
            raise ValueError("RoBERTa config has no pad_token_id: its position ids count from "
                             "padding_idx + 1")
        super().__init__(config, *args, **kwargs)

    @classmethod
    def position_offset(cls, config: Any) -> int:
        """Position-table rows before the first token's (``padding_idx + 1``): the model
        covers ``max_position_embeddings`` minus this many tokens."""
        return int(config.pad_token_id) + 1
