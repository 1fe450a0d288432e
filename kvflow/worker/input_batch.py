"""The model runner's persistent input batch: one row per request it computes, kept in place.

The scheduler sends each request whole once and then only what changed (see
``kvflow/sched_output.py``); the runner applies those changes to these numpy rows
(``worker/input_batch_diffs.py``) instead of rebuilding every request's state each step. Rows ``[0, num_reqs)`` are dense: removing a
request moves the last row into its place, so a step's arrays are slices and fancy indexes of
these columns, never Python loops over tokens.

Per row: the token ids (prompt, then generated; during a speculative-decoding step the draft
tokens follow them, past ``num_tokens``), how many are known, how many are in the
prompt and how many have K/V cached (and how many have a draft model's K/V), one block table
per KV-cache group, the sampling
parameters as columns (temperature, top-k/p, min-p, penalties, min_tokens), and which of the
row's tokens is still on the device (``pending_sample``: async scheduling samples a token,
launches the next step with it, and copies it to the host later). Rarely used per-request
settings (sampling seeds, logprobs, logit bias, min_tokens bans, allowed token ids, bad
words' token ids, thinking budgets) live in small dicts keyed by request id.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvflow.kv_cache_interface import KVCacheSpec
from kvflow.thinking_budget import ThinkingBudgetScan
from kvflow.worker.request_state import RequestState, request_stop_ids

# float32's largest finite value: a larger temperature or repetition penalty (SamplingParams
# takes any finite float) would be inf in its float32 column (and a RuntimeWarning in the
# log), and -inf / inf (a masked token) is NaN.
_F32_MAX = float(np.finfo(np.float32).max)


class InputBatch:
    """Rows of the requests a runner computes, updated in place.

    Args:
        max_num_reqs: most rows (the scheduler's ``max_num_seqs``).
        kv_cache_specs: the spec of each KV-cache group (one block table each).

    Token and block-table columns start narrow and double when a row needs more; block-table
    entries past a row's blocks are always 0 (the null block).
    """

    def __init__(self, max_num_reqs: int, kv_cache_specs: Sequence[KVCacheSpec]) -> None:
        n = self.max_num_reqs = max_num_reqs
        self.kv_cache_specs = tuple(kv_cache_specs)
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        self.version = 0  # bumped whenever a row is added, removed or moved
        # request ids given a row since custom logits processors last looked (a set only
        # when they are configured: worker/logits_procs.py takes it each step)
        self.added_ids: set[str] | None = None
        self._pending_rows: tuple[int, np.ndarray | slice] = (-1, slice(0, 0))
        # rows_of's last answer: (version, the ids asked, their rows)
        self._rows_memo: tuple[int, list[str], np.ndarray] = (-1, [], np.zeros(0, np.int64))
        self.token_ids = np.zeros((n, 64), np.int64)
        self.num_tokens = np.zeros(n, np.int64)  # prompt + sampled (pending included)
        self.num_prompt_tokens = np.zeros(n, np.int64)
        self.num_computed_tokens = np.zeros(n, np.int64)
        self.num_draft_computed = np.zeros(n, np.int64)  # positions with a draft model's K/V
        self.pending_sample = np.full(n, -1, np.int64)  # index in the pending sampled tensor
        self.lora_ids = np.zeros(n, np.int64)  # LoRA adapter id (0: the base model)
        # the prompt came as embeddings: its ids are placeholders (penalties skip them)
        self.prompt_is_embeds = np.zeros(n, np.bool_)
        self.block_tables = [np.zeros((n, 16), np.int32) for _ in self.kv_cache_specs]
        self.num_blocks = [np.zeros(n, np.int64) for _ in self.kv_cache_specs]
        self._init_sampling_columns(n)

    def _init_sampling_columns(self, n: int) -> None:
        self.temperature = np.zeros(n, np.float32)
        self.top_k = np.zeros(n, np.int64)
        self.top_p = np.ones(n, np.float32)
        self.min_p = np.zeros(n, np.float32)
        self.presence_penalty = np.zeros(n, np.float32)
        self.frequency_penalty = np.zeros(n, np.float32)
        self.repetition_penalty = np.ones(n, np.float32)
        self.uses_penalties = np.zeros(n, np.bool_)
        self.min_tokens = np.zeros(n, np.int64)
        # sparse settings, by request id (only rows that use them)
        self.seeds: dict[str, int] = {}  # request_seed: seeded random rows
        self.num_logprobs: dict[str, int] = {}
        self.logprob_token_ids: dict[str, list[int]] = {}  # SamplingParams.logprob_token_ids
        self.logit_bias: dict[str, dict[int, float]] = {}
        # allowed_token_ids as int64 [K] host tensors, built once when the row is added
        self.allowed_token_ids: dict[str, torch.Tensor] = {}
        self.bad_words: dict[str, list[list[int]]] = {}  # SamplingParams.bad_words_token_ids
        self.min_tokens_banned: dict[str, list[int]] = {}
        self.stop_ids: dict[str, list[int]] = {}  # request_stop_ids, when it has any
        self.prompt_logprobs: dict[str, int] = {}  # top tokens per prompt position
        # thinking_token_budget rows: a scan made when the row is added (a preempted request
        # reads its prompt and generated tokens again)
        self.thinking_budgets: dict[str, ThinkingBudgetScan] = {}

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def _row_columns(self) -> list[np.ndarray]:
        """Every array indexed by row first (moved together when rows are condensed)."""
        return [self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens,
                self.num_draft_computed, self.pending_sample, self.lora_ids,
                self.prompt_is_embeds, *self.num_blocks,
                self.temperature, self.top_k, self.top_p, self.min_p, self.presence_penalty,
                self.frequency_penalty,
                self.repetition_penalty, self.uses_penalties, self.min_tokens]

    # ---- rows in and out ---------------------------------------------------------------------
    def add_request(self, state: RequestState, output_token_ids: list[int],
                    block_ids: tuple[list[int], ...], num_computed_tokens: int) -> int:
        """Append a row for ``state`` (prompt + ``output_token_ids`` known, ``block_ids`` one
        table per group); returns its row.

        Raises:
            ValueError: if the batch is full or the request already has a row.
        """
        if state.req_id in self.req_id_to_index:
            raise ValueError(f"request {state.req_id!r} already has a row")
        row = len(self.req_ids)
        if row >= self.max_num_reqs:
            raise ValueError(f"the input batch holds at most {self.max_num_reqs} requests")
        self.req_ids.append(state.req_id)
        self.req_id_to_index[state.req_id] = row
        self.version += 1
        if self.added_ids is not None:
            self.added_ids.add(state.req_id)
        tokens = state.prompt_token_ids + output_token_ids
        self._ensure_token_width(len(tokens))
        self.token_ids[row, :len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(state.prompt_token_ids)
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_draft_computed[row] = 0  # a cached block may lack the draft K/V (draft_model.py)
        self.pending_sample[row] = -1
        self.lora_ids[row] = 0 if state.lora_request is None else state.lora_request.lora_int_id
        self.prompt_is_embeds[row] = state.prompt_embeds is not None
        for g, ids in enumerate(block_ids):
            self.block_tables[g][row] = 0
            self.num_blocks[g][row] = 0
            self.append_block_ids(row, g, ids)
        self._set_sampling(row, state)
        return row

    def _set_sampling(self, row: int, state: RequestState) -> None:
        p, rid = state.sampling_params, state.req_id
        self.temperature[row], self.top_k[row] = min(p.temperature, _F32_MAX), p.top_k
        self.top_p[row], self.min_p[row] = p.top_p, p.min_p
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.repetition_penalty[row] = min(p.repetition_penalty, _F32_MAX)
        self.uses_penalties[row] = p.uses_penalties
        self.min_tokens[row] = p.min_tokens
        if state.seed is not None:
            self.seeds[rid] = state.seed
        if p.logprob_token_ids:  # its listed tokens' logprobs in place of the top ones
            self.num_logprobs[rid] = len(p.logprob_token_ids)
            self.logprob_token_ids[rid] = p.logprob_token_ids
        elif p.logprobs is not None:
            self.num_logprobs[rid] = p.logprobs
        if p.logit_bias:
            self.logit_bias[rid] = p.logit_bias
        if p.allowed_token_ids:
            self.allowed_token_ids[rid] = torch.tensor(p.allowed_token_ids, dtype=torch.int64)
        if p.bad_words_token_ids:
            self.bad_words[rid] = p.bad_words_token_ids
        stop = request_stop_ids(state)
        if stop:
            self.stop_ids[rid] = stop
        if p.min_tokens > 0 and stop:
            self.min_tokens_banned[rid] = stop
        if p.prompt_logprobs is not None:
            self.prompt_logprobs[rid] = p.prompt_logprobs
        if p.thinking_token_budget is not None and p.reasoning_token_ids is not None:
            # the prompt counts, under a grammar too: the grammar starts after the reasoning
            # (``structured/reasoning_gate.py``), so the forced end marker hands over to it
            self.thinking_budgets[rid] = ThinkingBudgetScan(
                p.thinking_token_budget, p.reasoning_token_ids)

    def remove_request(self, req_id: str) -> bool:
        """Drop the request's row (the last row moves into it); False if it has none."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return False
        self.version += 1
        last = len(self.req_ids) - 1
        if row != last:
            self._move_row(last, row)
        self.req_ids.pop()
        for sparse in (self.seeds, self.num_logprobs, self.logprob_token_ids, self.logit_bias,
                       self.allowed_token_ids, self.bad_words, self.min_tokens_banned,
                       self.stop_ids, self.prompt_logprobs, self.thinking_budgets):
            sparse.pop(req_id, None)
        return True

    def _move_row(self, src: int, dst: int) -> None:
        for column in self._row_columns():
            column[dst] = column[src]
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        for table, num in zip(self.block_tables, self.num_blocks):
            table[dst] = table[src]  # whole rows: entries past the blocks stay 0
        moved = self.req_ids[src]
        self.req_ids[dst] = moved
        self.req_id_to_index[moved] = dst

    def rows_of(self, req_ids: list[str]) -> np.ndarray:
        """The rows of ``req_ids``, in their order (int64 [len(req_ids)], read-only).

        A decode step schedules the previous step's requests over the same rows, so the last
        answer is kept and given again while no row was added, removed or moved
        (``version``) and the ids are equal: one list comparison instead of a dict lookup
        per request and a new array.

        Raises:
            KeyError: for an id without a row.
        """
        version, ids, rows = self._rows_memo
        if version == self.version and ids == req_ids:
            return rows
        rows = np.fromiter(map(self.req_id_to_index.__getitem__, req_ids), np.int64,
                           len(req_ids))
        rows.flags.writeable = False
        self._rows_memo = (self.version, list(req_ids), rows)
        return rows

    # ---- in-place updates --------------------------------------------------------------------
    def append_block_ids(self, row: int, group: int, block_ids: list[int]) -> None:
        """Append ``block_ids`` to the row's table of KV-cache group ``group``."""
        start = self.num_blocks[group][row]
        end = start + len(block_ids)
        if end > self.block_tables[group].shape[1]:
            self.block_tables[group] = _widen(self.block_tables[group], end)
        self.block_tables[group][row, start:end] = block_ids
        self.num_blocks[group][row] = end

    def truncate_block_ids(self, row: int, num_blocks: int) -> None:
        """Cut the row's tables (every group) to their first ``num_blocks`` entries (the
        scheduler freed blocks that held only rejected draft tokens)."""
        for table, num in zip(self.block_tables, self.num_blocks):
            if num[row] > num_blocks:
                table[row, num_blocks:num[row]] = 0
                num[row] = num_blocks

    def write_draft_tokens(self, row: int, token_ids: list[int] | np.ndarray) -> None:
        """Put draft tokens after the row's known tokens (``num_tokens`` is unchanged: they
        become tokens only once accepted)."""
        start = int(self.num_tokens[row])
        self._ensure_token_width(start + len(token_ids))
        self.token_ids[row, start:start + len(token_ids)] = token_ids

    def accept_tokens(self, rows: np.ndarray, num_new: np.ndarray, last_token: np.ndarray) -> None:
        """After verification: row ``rows[i]`` keeps its first ``num_new[i] - 1`` draft tokens
        (already in place) and gains ``last_token[i]`` after them (int64 [R] each)."""
        self._ensure_token_width(int((self.num_tokens[rows] + num_new).max(initial=0)))
        self.token_ids[rows, self.num_tokens[rows] + num_new - 1] = last_token
        self.num_tokens[rows] += num_new
        # the draft model's K/V past the last accepted draft belongs to rejected tokens
        self.num_draft_computed[rows] = np.minimum(self.num_draft_computed[rows],
                                                   self.num_tokens[rows] - 1)

    def write_tokens(self, row: int, start: int, token_ids: list[int]) -> None:
        """Set the row's tokens at positions ``start`` on (tokens the scheduler sent)."""
        end = start + len(token_ids)
        self._ensure_token_width(end)
        self.token_ids[row, start:end] = token_ids
        self.num_tokens[row] = max(self.num_tokens[row], end)

    def index(self, rows: np.ndarray) -> np.ndarray | slice:
        """``rows`` (increasing int64 [R]) as an index: a slice when it is every row (numpy
        slices are views, fancy indexes copies)."""
        n = len(rows)
        return slice(0, n) if n == len(self.req_ids) and (n == 0 or rows[-1] == n - 1) \
            else rows

    def add_pending_tokens(self, rows: np.ndarray) -> None:
        """Each row in ``rows`` (increasing int64 [R]) gained one sampled token that is still
        on the device: row ``rows[i]``'s is entry ``i`` of the step's sampled tensor."""
        index = self.index(rows)
        self._ensure_token_width(int(self.num_tokens[index].max(initial=0)) + 1)
        self.pending_sample[index] = np.arange(len(rows))
        self.num_tokens[index] += 1
        self._pending_rows = (self.version, index)

    def fill_pending_tokens(self, sampled: np.ndarray) -> None:
        """Write the pending tokens' values (``sampled``: int64 [R], the step's sampled
        tensor on the host) into their rows; rows removed meanwhile are skipped."""
        version, rows = self._pending_rows
        if version == self.version:  # no row added, removed or moved since: same order
            if isinstance(rows, slice):
                rows = np.arange(rows.stop)
            self.token_ids[rows, self.num_tokens[rows] - 1] = sampled
        else:
            rows = np.flatnonzero(self.pending_sample[:self.num_reqs] >= 0)
            self.token_ids[rows, self.num_tokens[rows] - 1] = sampled[self.pending_sample[rows]]
        self.pending_sample[rows] = -1

    def _ensure_token_width(self, width: int) -> None:
        if width > self.token_ids.shape[1]:
            self.token_ids = _widen(self.token_ids, width)

    # ---- views for the sampler ---------------------------------------------------------------
    def num_output_tokens(self, rows: np.ndarray) -> np.ndarray:
        """Generated tokens of each row in ``rows`` (int64 [R])."""
        return self.num_tokens[rows] - self.num_prompt_tokens[rows]

    def output_tail(self, row: int, length: int, num_extra: int = 0) -> list[int]:
        """The last ``length`` (at most) generated tokens of ``row``, counting its first
        ``num_extra`` draft tokens as generated (they follow its known tokens); on the host."""
        end = int(self.num_tokens[row]) + num_extra
        start = max(int(self.num_prompt_tokens[row]), end - length)
        return self.token_ids[row, start:end].tolist()

    def tokens_through(self, row: int, num_extra: int = 0) -> np.ndarray:
        """The row's known tokens (prompt, then generated) and its first ``num_extra`` draft
        tokens (int64 [L], a view); on the host."""
        return self.token_ids[row, :int(self.num_tokens[row]) + num_extra]

    def prompt_and_output_ids(self, rows: np.ndarray, num_extra: np.ndarray | None = None
                              ) -> tuple[np.ndarray, np.ndarray]:
        """(prompt ids [R, Lp], generated ids [R, Lo]) of ``rows``, right-padded with -1
        (int64; Lp, Lo >= 1); ``num_extra`` (int64 [R]) counts that many of each row's draft
        tokens as generated. A prompt given as embeddings has no ids (all -1: the
        repetition penalty sees its generated tokens only). Every token of those rows must
        be on the host."""
        n_prompt = self.num_prompt_tokens[rows]
        n_out = self.num_tokens[rows] - n_prompt
        if num_extra is not None:
            n_out = n_out + num_extra
        tokens = self.token_ids[rows]
        width = tokens.shape[1]
        prompt_cols = np.arange(max(1, int(n_prompt.max(initial=0))))
        known = np.where(self.prompt_is_embeds[rows], 0, n_prompt)
        prompt = np.where(prompt_cols < known[:, None],
                          tokens[:, np.minimum(prompt_cols, width - 1)], -1)
        out_cols = np.arange(max(1, int(n_out.max(initial=0))))
        index = np.minimum(n_prompt[:, None] + out_cols, width - 1)
        output = np.where(out_cols < n_out[:, None], np.take_along_axis(tokens, index, 1), -1)
        return prompt, output


def _widen(array: np.ndarray, width: int) -> np.ndarray:
    """A copy of 2-D ``array`` with at least ``width`` columns (doubling), zero-filled."""
    new_width = max(width, 2 * array.shape[1])
    wider = np.zeros((array.shape[0], new_width), array.dtype)
    wider[:, :array.shape[1]] = array
    return wider
