"""One step's sampling metadata, read from the persistent input batch's columns."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvflow.layers.sampling_metadata import PenaltyMetadata, SamplingMetadata
from kvflow.sched_output import GrammarBitmask
from kvflow.worker.input_batch import InputBatch


class SamplingInputs:
    """Builds each step's ``SamplingMetadata`` from the persistent batch's columns.

    The per-row settings that never change while a request has its row (temperature, top-k,
    top-p, min-p) are moved to the device once per batch composition: a step with the same
    rows as the previous one (the common decode step) reuses those tensors.

    Args:
        device: where the sampler runs.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._key: tuple[int, bytes] | None = None
        self._dense: tuple = ()
        self._allowed_key: tuple | None = None
        self._allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def build(self, batch: InputBatch, rows: np.ndarray,
              grammar: GrammarBitmask | None = None,
              num_extra: np.ndarray | None = None) -> SamplingMetadata:
        """Sampling settings of the batch rows ``rows`` (int64 [B], sampling row ``i`` = batch
        row ``rows[i]``): dense columns are sliced, the per-request dicts mapped to sampling
        rows. Every token of those rows must be on the host (penalties and min_tokens read
        them).

        Speculative decoding (``num_extra`` given, int64 [B]): a request has one sampling row
        per draft token plus one, consecutive in ``rows``; row ``i`` predicts the token after
        ``num_extra[i]`` of the request's drafts, which count as generated for its penalties,
        ``min_tokens`` and ``bad_words``; ``logit_bias`` and ``allowed_token_ids`` apply to
        every row. Seeds are left to the rejection sampler (``SpecLayout.seeded``).

        Raises:
            KeyError: if ``grammar`` names a request without a row among ``rows``.
        """
        temperature, top_k, top_p, min_p, all_greedy = self._dense_columns(batch, rows)
        meta = SamplingMetadata(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                all_greedy=all_greedy)
        if num_extra is not None:
            return self._fill_expanded(meta, batch, rows, num_extra, grammar)
        position = _sampling_positions(batch, rows)
        for rid, seed in batch.seeds.items():
            if (i := position.get(rid)) is not None and batch.temperature[rows[i]] > 0:
                meta.seeded[i] = (seed, int(batch.num_output_tokens(rows[i:i + 1])[0]))
        for rid, banned in batch.min_tokens_banned.items():
            if (i := position.get(rid)) is not None and \
                    batch.num_output_tokens(rows[i:i + 1])[0] < batch.min_tokens[rows[i]]:
                meta.banned_token_ids[i] = banned
        for rid, k in batch.num_logprobs.items():
            if (i := position.get(rid)) is not None:
                meta.num_logprobs[i] = k
        for rid, listed in batch.logprob_token_ids.items():
            if (i := position.get(rid)) is not None:
                meta.logprob_token_ids[i] = listed
        meta.penalties = _penalties(batch, rows, self.device)
        rows_of = {rid: (i,) for rid, i in position.items()}
        meta.logit_bias = _logit_bias(batch, rows_of, self.device) if batch.logit_bias else None
        meta.allowed_token_ids = self._allowed_token_ids(batch, rows_of)
        _bad_words(meta, batch, rows, rows_of, None)
        grammar_rows = None
        if grammar is not None:
            position = position or _sampling_positions(batch, rows, always=True)
            grammar_rows = [position[rid] for rid in grammar.request_ids]
            meta.grammar = grammar_rows, grammar.bitmask.to(self.device, non_blocking=True)
        if batch.thinking_budgets:
            _forced_tokens(meta, batch, rows, rows_of, None, grammar, grammar_rows)
        return meta

    def _fill_expanded(self, meta: SamplingMetadata, batch: InputBatch, rows: np.ndarray,
                       num_extra: np.ndarray, grammar: GrammarBitmask | None
                       ) -> SamplingMetadata:
        """The per-request settings of a verification step's sampling rows (see ``build``)."""
        spans = _request_spans(batch, rows)
        for rid, banned in batch.min_tokens_banned.items():
            if (span := spans.get(rid)) is not None:
                start, count = span
                num_out = batch.num_output_tokens(rows[start:start + 1])[0]
                for i in range(start, start + count):
                    if num_out + num_extra[i] < batch.min_tokens[rows[i]]:
                        meta.banned_token_ids[i] = banned
        for rid, k in batch.num_logprobs.items():
            if (span := spans.get(rid)) is not None:
                meta.num_logprobs.update(dict.fromkeys(range(span[0], span[0] + span[1]), k))
        for rid, listed in batch.logprob_token_ids.items():
            if (span := spans.get(rid)) is not None:
                meta.logprob_token_ids.update(dict.fromkeys(range(span[0], span[0] + span[1]),
                                                            listed))
        meta.penalties = _penalties(batch, rows, self.device, num_extra)
        rows_of = {rid: range(s, s + c) for rid, (s, c) in spans.items()}
        meta.logit_bias = _logit_bias(batch, rows_of, self.device) if batch.logit_bias else None
        meta.allowed_token_ids = self._allowed_token_ids(batch, rows_of)
        _bad_words(meta, batch, rows, rows_of, num_extra)
        grammar_rows = None
        if grammar is not None:
            grammar_rows, seen = [], {}
            for rid in grammar.request_ids:  # a request's k + 1 rows, in order
                grammar_rows.append(spans[rid][0] + seen.get(rid, 0))
                seen[rid] = seen.get(rid, 0) + 1
            meta.grammar = grammar_rows, grammar.bitmask.to(self.device, non_blocking=True)
        if batch.thinking_budgets:
            _forced_tokens(meta, batch, rows, rows_of, num_extra, grammar, grammar_rows)
        return meta

    def _allowed_token_ids(self, batch: InputBatch, rows_of: dict[str, Sequence[int]]
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``SamplingMetadata.allowed_token_ids`` of the sampling rows ``rows_of`` (request
        id -> its sampling rows), or None when none is limited. Each request's ids are an
        int64 tensor built once, when its row was added (``InputBatch.allowed_token_ids``);
        they are concatenated and moved to the device only when the batch's rows
        (``batch.version``) or the sampling rows change, so a decode step with the same rows
        as the previous one reuses the last step's tensors (measured in
        benchmarks/allowed_token_ids_host.py)."""
        if not batch.allowed_token_ids:
            return None
        entries = tuple((rid, i) for rid in batch.allowed_token_ids
                        for i in rows_of.get(rid, ()))
        if not entries:
            return None
        key = (batch.version, entries)
        if key != self._allowed_key:
            ids = [batch.allowed_token_ids[rid] for rid, _ in entries]
            positions = torch.from_numpy(np.repeat(np.arange(len(entries), dtype=np.int64),
                                                   [len(t) for t in ids]))
            self._allowed = (
                torch.tensor([i for _, i in entries], dtype=torch.int64).to(self.device),
                positions.to(self.device), torch.cat(ids).to(self.device))
            self._allowed_key = key
        return self._allowed

    def _dense_columns(self, batch: InputBatch, rows: np.ndarray) -> tuple:
        """(temperature, top_k, top_p, min_p, all_greedy) of ``rows``, cached while the batch
        keeps its rows (``batch.version``) and the step samples the same ones."""
        key = (batch.version, rows.tobytes())
        if key != self._key:
            temperature = batch.temperature[rows]
            self._dense = (torch.from_numpy(temperature).to(self.device),
                           _column(batch.top_k, rows, 0, self.device),
                           _column(batch.top_p, rows, 1.0, self.device),
                           _column(batch.min_p, rows, 0.0, self.device),
                           not bool((temperature != 0).any()))
            self._key = key
        return self._dense


def _column(values: np.ndarray, rows: np.ndarray, unused: float,
            device: torch.device) -> torch.Tensor | None:
    """``values[rows]`` on the device, or None when no row uses the setting."""
    picked = values[rows]
    if (picked == unused).all():
        return None
    return torch.from_numpy(picked).to(device)


def _sampling_positions(batch: InputBatch, rows: np.ndarray,
                        always: bool = False) -> dict[str, int]:
    """Request id -> sampling row; empty (unless ``always``) when no request uses a
    per-request dict setting."""
    if not (always or batch.seeds or batch.min_tokens_banned or batch.num_logprobs
            or batch.logit_bias or batch.allowed_token_ids or batch.bad_words
            or batch.thinking_budgets):
        return {}
    return {batch.req_ids[r]: i for i, r in enumerate(rows.tolist())}


def _request_spans(batch: InputBatch, rows: np.ndarray) -> dict[str, tuple[int, int]]:
    """Request id -> (first sampling row, rows) when each request's rows are consecutive."""
    starts = np.flatnonzero(np.diff(rows, prepend=-1) != 0)
    counts = np.diff(starts, append=len(rows))
    return {batch.req_ids[rows[s]]: (int(s), int(c)) for s, c in zip(starts, counts)}


def _penalties(batch: InputBatch, rows: np.ndarray, device: torch.device,
               num_extra: np.ndarray | None = None) -> PenaltyMetadata | None:
    """Presence / frequency / repetition penalties of the sampling rows that use them
    (``num_extra``: draft tokens counted as generated, per sampling row)."""
    which = np.flatnonzero(batch.uses_penalties[rows])
    if len(which) == 0:
        return None
    picked = rows[which]
    prompt, output = batch.prompt_and_output_ids(
        picked, num_extra[which] if num_extra is not None else None)

    def floats(column: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(column[picked]).to(device)

    return PenaltyMetadata(torch.from_numpy(which).to(device),
                           torch.from_numpy(prompt).to(device),
                           torch.from_numpy(output).to(device),
                           floats(batch.presence_penalty), floats(batch.frequency_penalty),
                           floats(batch.repetition_penalty))


def _logit_bias(batch: InputBatch, rows_of: dict[str, Sequence[int]], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(sampling rows, token ids, biases) of every biased (row, token) pair, or None.

    ``rows_of``: request id -> its sampling rows (one, or a verification step's k + 1: the
    bias applies at every position, drafts included)."""
    entries = [(i, token_id, value) for rid, bias in batch.logit_bias.items()
               for i in rows_of.get(rid, ()) for token_id, value in bias.items()]
    if not entries:
        return None
    rows_, token_ids, values = zip(*entries)
    return (torch.tensor(rows_, dtype=torch.int64, device=device),
            torch.tensor(token_ids, dtype=torch.int64, device=device),
            torch.tensor(values, dtype=torch.float32, device=device))


def _bad_words(meta: SamplingMetadata, batch: InputBatch, rows: np.ndarray,
               rows_of: dict[str, Sequence[int]], num_extra: np.ndarray | None) -> None:
    """Add each row's bad-word bans to ``meta.banned_token_ids`` (``rows_of``: request id ->
    its sampling rows; ``num_extra``: drafts counted as generated per sampling row, None for
    none)."""
    for rid, words in batch.bad_words.items():
        longest = max(len(w) for w in words) - 1
        for i in rows_of.get(rid, ()):
            extra = 0 if num_extra is None else int(num_extra[i])
            past = batch.output_tail(int(rows[i]), longest, extra)
            banned = bad_word_bans(words, past)
            if banned:
                meta.banned_token_ids[i] = meta.banned_token_ids.get(i, []) + banned


def _forced_tokens(meta: SamplingMetadata, batch: InputBatch, rows: np.ndarray,
                   rows_of: dict[str, Sequence[int]], num_extra: np.ndarray | None,
                   grammar: GrammarBitmask | None, grammar_rows: list[int] | None) -> None:
    """Fill ``meta.forced_token_ids`` for the rows of requests with a thinking budget whose
    position must take the end-of-thinking marker's next token (``kvflow.thinking_budget``;
    ``num_extra``: drafts before each sampling row's position, None for none). A forced token
    the row's grammar does not allow is not forced (the grammar decides a constrained reply:
    the forced marker never contradicts it)."""
    allowed_by = dict(zip(grammar_rows, range(len(grammar_rows)))) if grammar_rows else {}
    for rid, scan in batch.thinking_budgets.items():
        sampling_rows = rows_of.get(rid, ())
        if not sampling_rows:
            continue
        row = int(rows[sampling_rows[0]])
        scan.commit(batch.tokens_through(row))
        num_known = int(batch.num_tokens[row])
        for i in sampling_rows:
            extra = 0 if num_extra is None else int(num_extra[i])
            token = scan.forced_token(batch.tokens_through(row, extra), num_known)
            if token is None:
                continue
            if i in allowed_by and not _allows(grammar, allowed_by[i], token):
                continue
            meta.forced_token_ids[i] = token


def _allows(grammar: GrammarBitmask, index: int, token: int) -> bool:
    """Whether bitmask row ``index`` of ``grammar`` (xgrammar's layout, on the host) allows
    ``token``."""
    word = int(grammar.bitmask[index, token // 32])
    return bool((word >> (token % 32)) & 1)


def bad_word_bans(words: list[list[int]], past: list[int]) -> list[int]:
    """The token ids banned next by bad words ``words`` (token-id sequences) after the
    generated tokens ``past`` (vLLM's rule): a word's last token when ``past`` ends with the
    word's other tokens (always for a one-token word)."""
    banned = []
    for word in words:
        prefix = word[:-1]
        if len(prefix) <= len(past) and past[len(past) - len(prefix):] == prefix:
            banned.append(word[-1])
    return banned
