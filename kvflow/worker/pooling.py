"""Pooling the hidden states of embedding requests into one vector each, across steps.

An embedding request is a prompt computed like any prefill (chunked over steps when it is long,
for decoder models) whose final hidden states are pooled instead of sampled from:
``last`` takes the last prompt token's row (computed in the step that finishes the prompt),
``cls`` the first token's (computed in the first chunk) and ``mean`` the average over every
prompt token (a float64 running sum per request that each chunk continues token by token, so
it is the same however the prompt is chunked: ``--deterministic`` holds for it). A preempted request
recomputes its prompt from the start, so its partial state is dropped. The vector is then cut
to the request's ``dimensions`` (Matryoshka) and L2-normalized when the request's
``normalize`` says so, else when the model normalizes.
A sequence classifier (``task="score"`` or ``"classify"``) pools ``cls`` (an encoder) or
``last`` (a decoder) and reports its classification head's logits on that state after the
activation of the request's task (sigmoid or identity for score, softmax or a one-label
sigmoid for classify; one engine serves both, see ``model_task``): ``num_labels`` values.

vLLM's per-token tasks keep every prompt token's row instead: each chunk's rows are appended
to the request's list (copied: the step's hidden-state buffer is reused) and, in the step that
finishes the prompt, joined into [num_prompt_tokens, H]. ``token_embed`` (an embedding
engine) cuts each row to ``dimensions`` and L2-normalizes it as ``embed`` would its vector;
``token_classify`` (a ``*ForTokenClassification`` engine) runs the head on every row and the
classify activation per row. A per-token request never takes a prefix-cache hit
(``Request.skips_prefix_cache``: the hit tokens would not be run, so their rows would be
missing), and its chunks' rows all land here. The rows travel flattened, row-major
(``num_prompt_tokens * D`` floats: the engine's output types stay ``list[float]``); the API
side reshapes them by the prompt's length (:func:`kvflow.outputs.token_rows`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from kvflow.models.pooling_config import PoolerConfig
from kvflow.pooling_params import PoolingParams
from kvflow.worker.input_batch import InputBatch


def finish_vector(vector: torch.Tensor, params: PoolingParams | None,
                  normalize: bool) -> list[float]:
    """float32 [H] -> the reported values: the first ``params.dimensions`` (if set), then
    L2-normalized as ``params.normalizes(normalize)`` says (its ``normalize`` or
    ``use_activation``, else the model's ``normalize``)."""
    if params is not None and params.dimensions is not None:
        vector = vector[:params.dimensions]
    if params is not None:
        normalize = params.normalizes(normalize)
    if normalize:
        vector = F.normalize(vector, dim=-1)
    return vector.tolist()


class PoolingState:
    """Per-request partial pools of one runner (see the module docstring).

    Args:
        config: the model's pooling.
        score_head: a sequence classifier's head, [N, hidden] -> [N, num_labels] logits (the
            model's ``score_head``), for ``config.task`` "score" or "classify".

    Raises:
        ValueError: for a score or classify config without a head.
    """

    def __init__(self, config: PoolerConfig,
                 score_head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        head_task = config.task in ("score", "classify", "token_classify")
        if head_task and score_head is None:
            raise ValueError(f"task={config.task!r} needs a model with a classification head "
                             "(score_head)")
        self.config = config
        self.score_head = score_head if head_task else None
        self._partial: dict[str, torch.Tensor] = {}  # cls: first row; mean: running sum
        self._rows: dict[str, list[torch.Tensor]] = {}  # per-token tasks: each chunk's rows

    def drop(self, req_id: str) -> None:
        """Forget a request's partial pool (finished, or preempted: recomputed from 0)."""
        self._partial.pop(req_id, None)
        self._rows.pop(req_id, None)

    def step(self, batch: InputBatch, rows: np.ndarray, query_start: np.ndarray,
             hidden: torch.Tensor, params: dict[str, PoolingParams | None]
             ) -> dict[str, list[float]]:
        """Fold one step's hidden states in; returns the vectors of the requests whose
        prompt the step finished.

        Args:
            batch: the persistent batch (computed counts before this step).
            rows / query_start: the step's scheduled rows and their first token (int64).
            hidden: [T, H] the step's final hidden states.
            params: request id -> its PoolingParams.
        """
        kind, done = self.config.pooling_type, {}
        for k, row in enumerate(rows.tolist()):
            rid = batch.req_ids[row]
            start, end = int(query_start[k]), int(query_start[k + 1])
            first = int(batch.num_computed_tokens[row]) == 0
            p = params.get(rid)
            if (p.per_token if p is not None else kind == "all"):
                if first:
                    self._rows[rid] = []
                self._rows[rid].append(hidden[start:end].clone())
                if int(batch.num_computed_tokens[row]) + end - start >= batch.num_tokens[row]:
                    done[rid] = self._per_token(torch.cat(self._rows.pop(rid)), p,
                                                int(batch.num_prompt_tokens[row]))
                continue
            if kind == "mean":
                self._partial[rid] = _running_sum(
                    None if first else self._partial[rid], hidden[start:end])
            elif kind == "cls" and first:
                self._partial[rid] = hidden[start].float()
            if int(batch.num_computed_tokens[row]) + end - start < batch.num_tokens[row]:
                continue  # the prompt goes on in a later step
            if kind == "last":
                vector = hidden[end - 1].float()
            elif kind == "mean":
                vector = (self._partial.pop(rid) / int(batch.num_prompt_tokens[row])).float()
            else:
                vector = self._partial.pop(rid)
            if self.score_head is not None:
                done[rid] = self._score(vector.to(hidden.dtype), p)
                continue
            done[rid] = finish_vector(vector, p, self.config.normalize)
        return done

    def _per_token(self, rows: torch.Tensor, params: PoolingParams | None,
                   num_prompt_tokens: int) -> list[float]:
        """[T, H] every prompt token's final hidden state -> the per-token task's
        [T, D] values flattened row-major (float32 values as a list): ``token_classify`` the
        head's logits of each row after the classify activation (D = ``num_labels``),
        ``token_embed`` each row cut to ``dimensions`` and L2-normalized as ``finish_vector``
        says (D = ``dimensions`` or H).

        Raises:
            RuntimeError: if T is not the prompt's length (a chunk's rows went missing).
        """
        if rows.shape[0] != num_prompt_tokens:
            raise RuntimeError(f"per-token pooling kept {rows.shape[0]} rows for a prompt of "
                               f"{num_prompt_tokens} tokens")
        task = params.task if params is not None else self.config.task
        if task == "token_classify":
            logits = self._calibrate(self.score_head(rows).float())
            return _activate(logits, self._activation(task, params)).flatten().tolist()
        values = rows.float()
        normalize = self.config.normalize
        if params is not None and params.dimensions is not None:
            values = values[:, :params.dimensions]
        if params is not None:
            normalize = params.normalizes(normalize)
        if normalize:
            values = F.normalize(values, dim=-1)
        return values.flatten().tolist()

    def _score(self, pooled: torch.Tensor, params: PoolingParams | None) -> list[float]:
        """[H] pooled state (CLS or last token) -> the ``num_labels`` values: head logits
        (float32), then the activation of the request's task (score: sentence-transformers'
        ``CrossEncoder.predict`` default; classify: softmax, the class probabilities, or the
        sigmoid of a single logit), none when the request asks for raw logits."""
        logits = self._calibrate(self.score_head(pooled.unsqueeze(0))[0].float())
        task = self.config.task if params is None else params.task
        return _activate(logits, self._activation(task, params)).tolist()

    def _calibrate(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 logits after the pooler config's affine calibration (``logit_mean``
        subtracted, then divided by ``logit_sigma``, each where set), as vLLM's
        ``ClassifierPoolerHead`` does before the activation."""
        if self.config.logit_mean is not None:
            logits = logits - self.config.logit_mean
        if self.config.logit_sigma is not None:
            logits = logits / self.config.logit_sigma
        return logits

    def _activation(self, task: str, params: PoolingParams | None) -> str | None:
        """The activation of a ``task`` request's logits: the task's (``activation_for``),
        or None (the raw logits) when its ``use_activation`` / ``activation`` is False, or
        unset and the pooler config's ``use_activation`` is False."""
        use = None if params is None else params.use_activation
        if not (self.config.use_activation if use is None else use):
            return None
        return self.config.activation_for(task)


def _activate(logits: torch.Tensor, activation: str | None) -> torch.Tensor:
    """float32 [..., num_labels] logits after ``activation`` ("sigmoid" elementwise,
    "softmax" over the last dimension, "identity" or None: unchanged)."""
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    return logits


def _running_sum(partial: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """``partial + rows[0] + rows[1] + ...`` added one row at a time, in float64.

    A left fold continued from ``partial`` performs the same additions whatever the chunk
    boundaries were (``.sum(0)`` of each chunk rounds in an order that depends on them); CPU
    ``cumsum`` is that sequential scan.

    Args:
        partial: float64 [H], the sum of the earlier chunks' rows (None: the first chunk).
        rows: [T, H] this chunk's hidden states (any float dtype).
    Returns:
        float64 [H].
    """
    rows = rows.double()
    if partial is not None:
        rows = torch.cat([partial.unsqueeze(0), rows])
    return rows.cumsum(0)[-1]
