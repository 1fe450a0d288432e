"""The draft model's LM head cut to frequent tokens (FR-Spec).

Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked
Speculative Sampling": a small draft model with a large vocabulary spends much of its pass in
the LM head (Qwen2.5's 151936 x 896 head is ~27% of the 0.5B model's weight bytes, and a
batch-1 pass reads every weight once), while the tokens it drafts that the target accepts are
almost all frequent ones. So the draft computes logits only for a subset ``S`` of the
vocabulary and drafts from it.

The subset, with no corpus at run time:

* the ``draft_vocab_size`` lowest token ids. In a byte-level BPE vocabulary (GPT-2, Llama 3,
  Qwen2) a token's id is its merge rank: merges are learnt most frequent pair first, so a
  lower id was a more frequent pair in the tokenizer's training corpus (FR-Spec ranks by
  counts on a corpus instead; the merge rank is the proxy available offline). Ids below the
  byte alphabet's 256 are single bytes, kept too;
* the end tokens of both models, so a draft can end an answer where the target does: each
  model's declared EOS ids (its generation_config.json's ``eos_token_id``, an int or a list,
  else its config's; a GGUF file's end-of-generation set: ``load_eos_token_ids``, which for
  the target the front end makes every request stop on). A base-model
  draft for an instruct target (Qwen2.5: ``<|endoftext|>`` against ``<|im_end|>``) has other
  end tokens than the target, and when the target's lay above the cut the draft could never
  propose them, so the last draft window of every answer was rejected. The draft's own end
  tokens are harmless to a target that does not stop on them: a drafted one is verified like
  any token, and accepted it is an ordinary token that the target's stop check ignores;
* each drafting request's own stop ids (its EOS, the tokenizer's when it has one, and its
  ``stop_token_ids``: ``InputBatch.stop_ids``, what ``check_stop`` ends it on), added with
  the context's tokens below: the runner has the target's configs but not its tokenizer;
* every token already in a drafting request's context (prompt and output): code repeats its
  identifiers, and a rare identifier the prompt uses is likely to come back. These rows are
  gathered from the full head each step (``DraftVocab.update``); a few hundred rows cost
  little next to the subset's tens of thousands.

Exactness. The draft's distribution is ``q(x) = softmax(z_S / T)(x)`` on ``S`` and ``q(x) = 0``
outside it (a greedy draft is the argmax over ``S``). Rejection sampling
(kvflow/spec_decode/rejection_sampler.py) needs nothing of ``q`` but that the draft ``d`` is a
sample of the ``q`` handed to it: ``d`` is accepted with probability ``min(1, p(d) / q(d))``,
only ever evaluated at a drafted ``d``, where ``q(d) > 0``; on a rejection the token comes from
``max(0, p - q) / Z``, which is ``p`` itself on every ``x`` outside ``S``. At one position
``P(x) = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x)`` for every ``x``: for ``x`` outside
``S`` the first term is 0 and the second ``p(x)``. So the output is the target's distribution
whatever ``S`` is; ``S`` only changes how often drafts are accepted. Greedy requests verify by
the target's argmax, so their text is plain greedy decoding's.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from kvflow.layers.embedding import ParallelLMHead


def frequent_token_ids(vocab_size: int, draft_vocab_size: int,
                       always: Iterable[int] = ()) -> np.ndarray:
    """The subset's fixed part: ids ``[0, draft_vocab_size)`` (the lowest merge ranks) and
    ``always`` (both models' end tokens), sorted, unique, int64
    [<= draft_vocab_size + len(always)].

    Raises:
        ValueError: for a ``draft_vocab_size`` below 1 or an id outside the vocabulary.
    """
    if draft_vocab_size < 1:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be >= 1")
    extra = np.asarray(list(always), np.int64)
    if len(extra) and (extra.min() < 0 or extra.max() >= vocab_size):
        raise ValueError(f"token ids {extra.tolist()} are outside the vocabulary of "
                         f"{vocab_size} tokens")
    return np.union1d(np.arange(min(draft_vocab_size, vocab_size), dtype=np.int64), extra)


def restrict_lm_head(head: ParallelLMHead, keep: torch.Tensor) -> ParallelLMHead:
    """An LM head over the rows ``keep`` (int64 [S], ids of ``head``'s vocabulary) of ``head``:
    the same quantization method, each of its per-row tensors (``weight``, and e.g. INT8's
    ``weight_scale``) cut to those rows (copies), no packed weight (pack it like any head).
    Row ``i`` of its logits is row ``keep[i]`` of ``head``'s.

    Raises:
        ValueError: for a head split over tensor-parallel ranks, or one whose weight was
            emptied by packing (restrict it before packing).
    """
    if head.tp_size != 1:
        raise ValueError("a draft LM head restricted to frequent tokens needs tp_size 1")
    if head.weight.shape[0] < head.vocab_size:
        raise ValueError("the LM head's weight was emptied by packing; restrict it first")
    sub = copy.copy(head)  # the attributes; the tensors are replaced below
    sub._parameters = dict(head._parameters)
    sub._buffers = dict(head._buffers)
    sub._modules = dict(head._modules)
    rows = keep.to(head.weight.device)
    for name in head._quant_param_names:
        param = getattr(head, name)
        if param.dim() >= 1 and param.shape[0] == head.shard_size:
            setattr(sub, name, nn.Parameter(param.data[rows].clone(), requires_grad=False))
    sub.vocab_size = sub.shard_size = len(keep)
    sub.packed_weight, sub.gemm_workspace = None, None
    return sub


class DraftVocab:
    """Installs the restricted head on a draft model and maps its logits back to token ids.

    Construction replaces ``model.lm_head`` by the head over the fixed subset
    (:func:`frequent_token_ids`), so the runner packs that one for the CPU GEMM; the full head
    is kept unpacked, off the model, for the context tokens' rows.

    Args:
        model: the draft model (``lm_head``: a :class:`ParallelLMHead`, ``compute_logits``).
        draft_vocab_size: ids kept by merge rank.
        always: ids always kept (the draft's and the target's end tokens).

    Attributes:
        fixed_ids: int64 [S] numpy, the fixed subset.
        token_ids: int64 [S + E] tensor: column ``i`` of :meth:`logits` is token
            ``token_ids[i]`` (the fixed subset, then this step's context tokens outside it).
    """

    def __init__(self, model: nn.Module, draft_vocab_size: int,
                 always: Iterable[int] = ()) -> None:
        self.full_head: ParallelLMHead = model.lm_head
        vocab_size = self.full_head.vocab_size
        self.fixed_ids = frequent_token_ids(vocab_size, draft_vocab_size, always)
        self._in_fixed = np.zeros(vocab_size, np.bool_)
        self._in_fixed[self.fixed_ids] = True
        self.fixed_head = restrict_lm_head(self.full_head, torch.from_numpy(self.fixed_ids))
        model.lm_head = self.fixed_head
        self.model = model
        self._extra_ids = np.zeros(0, np.int64)
        self._extra_head: ParallelLMHead | None = None
        device = self.full_head.weight.device
        self.token_ids = torch.from_numpy(self.fixed_ids).to(device)

    def update(self, token_ids: np.ndarray, num_tokens: np.ndarray, rows: np.ndarray,
               stop_ids: Iterable[Iterable[int]] = ()) -> None:
        """Add this step's context tokens and stop ids: the tokens of ``rows`` (their first
        ``num_tokens[r]`` entries of ``token_ids`` [num_rows, width]; negative placeholders
        skipped) and the ids in ``stop_ids`` (each drafting request's ids that end it, e.g.
        its tokenizer's EOS when that is not among the fixed subset's end tokens; ids outside
        the vocabulary skipped) outside the fixed subset get their rows of the full head
        (gathered again only when the set changes)."""
        seen = np.zeros(len(self._in_fixed), np.bool_)
        for r in rows.tolist():
            ids = token_ids[r, :num_tokens[r]]
            seen[ids[ids >= 0]] = True
        for ids in stop_ids:
            stops = np.fromiter(ids, np.int64)
            seen[stops[(stops >= 0) & (stops < len(seen))]] = True
        seen &= ~self._in_fixed
        extra = np.flatnonzero(seen)
        if np.array_equal(extra, self._extra_ids):
            return
        self._extra_ids = extra
        self._extra_head = restrict_lm_head(self.full_head, torch.from_numpy(extra)) \
            if len(extra) else None
        ids = np.concatenate([self.fixed_ids, extra])
        self.token_ids = torch.from_numpy(ids).to(self.full_head.weight.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 [N, S + E], columns in ``token_ids``' order (each part the
        model's ``compute_logits`` with that part's head, so a soft-cap the model applies
        applies to both; the model is not changed)."""
        logits = self.model.compute_logits(hidden, head=self.fixed_head)
        if self._extra_head is None:
            return logits
        extra = self.model.compute_logits(hidden, head=self._extra_head)
        return torch.cat([logits, extra], dim=1)

    def to_full(self, probs: torch.Tensor) -> torch.Tensor:
        """A distribution over the subset's columns (float32 [S + E]) as one over the whole
        vocabulary (float32 [V], zero outside the subset)."""
        full = probs.new_zeros(self.full_head.vocab_size)
        full[self.token_ids] = probs
        return full


class HeadVocab:
    """A draft head's own, fixed vocabulary (EAGLE-3's ``draft_vocab_size`` columns, each a
    target token through ``d2t``), with :class:`DraftVocab`'s interface: the draft distribution
    is zero outside it, which keeps the output exact for the reason the module docstring gives.

    Args:
        model: the head (``compute_logits(hidden [N, H]) -> float32 [N, S]``).
        token_ids: int64 [S], column ``i``'s target token id (unique).
        vocab_size: the target's vocabulary size V.
    """

    def __init__(self, model: nn.Module, token_ids: torch.Tensor, vocab_size: int) -> None:
        self.model = model
        self.token_ids = token_ids
        self.vocab_size = vocab_size

    def update(self, *args: object) -> None:
        """Nothing: the columns do not change with the context."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 [N, S], columns in ``token_ids``' order."""
        return self.model.compute_logits(hidden)

    def to_full(self, probs: torch.Tensor) -> torch.Tensor:
        """float32 [S] over the columns -> float32 [V], zero outside ``token_ids``."""
        full = probs.new_zeros(self.vocab_size)
        full[self.token_ids] = probs
        return full
