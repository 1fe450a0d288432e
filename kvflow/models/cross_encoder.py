"""Cross-encoders for scoring query/document pairs (``--task score``): BERT and
(XLM-)RoBERTa with their HF sequence-classification heads (sentence-transformers'
``CrossEncoder``: ms-marco MiniLM, BGE rerankers, ...).

A pair is one prompt, tokenized as the tokenizer does ``(text, text_pair)``:
``[CLS] A [SEP] B [SEP]`` for BERT, whose second segment takes token type 1
(``token_type_ids``: the runner passes them, built from ``PoolingParams.second_segment_start``),
``<s> A </s></s> B </s>`` for RoBERTa (one token type). The encoder is
:class:`~kvflow.models.bert.BertModel` / :class:`~kvflow.models.roberta.RobertaModel`; the runner
pools the first token's hidden state (CLS / ``<s>``) and calls :meth:`score_head` on it:

- BERT (``BertForSequenceClassification``): ``classifier(tanh(pooler.dense(h)))`` (the HF
  pooler, then the classifier);
- RoBERTa (``RobertaForSequenceClassification``): ``out_proj(tanh(dense(h)))``
  (``RobertaClassificationHead``).

Dropout is off at inference. The activation (sigmoid for one label, none for several: the
``CrossEncoder`` default) is applied by the runner (``worker/pooling.py``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from kvflow.models.bert import BertModel
from kvflow.models.roberta import RobertaModel


class _BertPooler(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)


class BertForSequenceClassification(BertModel):
    """BERT encoder + HF pooler + classifier: ``forward`` as BertModel (with token types),
    :meth:`score_head` on the CLS rows.

    Raises:
        ValueError: as BertModel's constructor.
    """

    is_cross_encoder: ClassVar[bool] = True
    uses_token_types: ClassVar[bool] = True
    skipped_prefixes: ClassVar[tuple[str, ...]] = ("cls.",)

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.pooler = _BertPooler(config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def score_head(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] first-token hidden states -> [N, num_labels] logits (no activation)."""
        return self.classifier(torch.tanh(self.pooler.dense(cls_hidden)))


class _RobertaClassificationHead(nn.Module):
    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, num_labels)


class RobertaForSequenceClassification(RobertaModel):
    """RoBERTa / XLM-RoBERTa encoder + classification head: ``forward`` as RobertaModel,
    :meth:`score_head` on the ``<s>`` rows.

    Raises:
        ValueError: as RobertaModel's constructor.
    """

    is_cross_encoder: ClassVar[bool] = True
    skipped_prefixes: ClassVar[tuple[str, ...]] = ("lm_head.", "pooler.")

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.classifier = _RobertaClassificationHead(config.hidden_size, config.num_labels)

    def score_head(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] first-token hidden states -> [N, num_labels] logits (no activation)."""
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(cls_hidden)))
