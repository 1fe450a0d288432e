"""EAGLE speculative decoding (``{"method": "eagle", "model": HEAD}``): a one-layer draft head
fed the target's final hidden states (kvflow/models/eagle.py; Li et al. 2024, arXiv
2401.15077; EAGLE-3, ``{"method": "eagle3"}``, the same way with the features ``fc`` of three
target layers' residual streams instead: kvflow/models/eagle3.py, spec_decode/layer_taps.py;
and DeepSeek-V3's MTP layer the same way, ``{"method": "deepseek_mtp"}``:
kvflow/models/deepseek_mtp.py), proposing inside the target's model runner like a draft model
(draft_model.py: the same lazy "mirror" pass, its own paged K/V in the target's blocks,
``num_draft_computed``).

Coordinates: the head's K/V of token index ``j >= 1`` sits at position ``j - 1`` and holds
``(x[j], f[j-1])`` (the token and the target's feature that predicted it: EAGLE shifts the
tokens one left of the features), so ``num_draft_computed = D`` means the positions ``0 ..
D - 2`` hold the head's K/V; token 0 has none. The mirror pass of a request with tokens
``x[0..n]`` (``x[n]`` sampled last step) computes indices ``D .. n`` and its last output
``h'[n-1]`` gives draft 1; draft ``i + 1`` then feeds draft ``i`` with the head's own output
in place of the target's feature (EAGLE's autoregression over features).

The target's features: after each target forward the runner hands this module the step's
final hidden states (``observe_target``); the head reads a prompt chunk's at once (one head
pass over the chunk), and the ``FeatureStash`` keeps per request only what the head will
still read: at most a verification step's k + 1 rows (features of rejected drafts are
overwritten by the next step's), one row while adaptive lengths leave the request undrafted.
Each mirror pass starts at the first kept feature, so the head's K/V of accepted drafts
(written from its own fed-back outputs) is computed again from the target's features, as
vLLM's proposer does. Positions the target never computed (a prefix-cache hit) have no feature: the head starts after them, and attends there to the
K/V the cached blocks hold (the head's, written when a request drafting through them filled
them, or stale): only the acceptance rate can suffer, never the output, which verification
keeps exact. Constrained (structured-output) requests are drafted for as by a draft model.

Tensor parallelism: every rank runs the whole head (its layer unsharded, as a draft model is:
the head's K/V, all its KV heads, sits in each rank's blocks, sized by the head's own layer
spec), fed the target's features, which are whole on every rank (the final hidden states and
EAGLE-3's residual-stream taps follow the row-parallel all-reduces). A head sharing the
target's vocabulary-parallel embedding and LM head calls them as the target does (an
all-reduce, an all-gather): every rank runs the same passes over the same batch, so the
collectives pair up, and no rank holds a second [V, H] copy. The ranks then take TP rank 0's
proposal (``share_proposal``), so they verify the same drafts even where their passes round
differently (a draft chosen differently mid-proposal feeds the shared embedding other tokens
on each rank: the later drafts are then wrong on all ranks alike, which lowers acceptance,
never the output). A one-layer head is small next to the sharded target (DeepSeek-V3's MTP layer,
MoE included, is not: each rank holds all of it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvflow.attention.layer import AttentionContext
from kvflow.config import EngineConfig
from kvflow.distributed.comm import CommGroup
from kvflow.layers.rotary import long_prompt_rope
from kvflow.models.loader import load_hf_config
from kvflow.models.model_resolver import resolve_model
from kvflow.spec_decode.draft_model import DraftModel, _naming_the_draft
from kvflow.spec_decode.draft_vocab import HeadVocab
from kvflow.spec_decode.feature_stash import FeatureStash, ramp
from kvflow.spec_decode.head_loading import (
    extend_head_positions,
    load_eagle3,
    load_head,
    load_mtp,
    tensor_names,
)
from kvflow.spec_decode.layer_taps import LayerTaps
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.model_inputs import InputStager, ModelInputs, build_model_inputs


class EagleDrafter(DraftModel):
    """The EAGLE head, its attention context and K/V, proposing as a ``DraftModel`` does.

    Args:
        config: the engine config (``speculative_config.model`` names the head).
        backend: an attention backend instance for the head's layer.
        dtype / device: the target's compute dtype and device.
        target: the target model (its embedding and LM head serve a head without its own).
        target_vocab_size: rows of the target's logits; the head must have as many.
        tp_group: the target's tensor-parallel group: every rank runs the whole head, then
            takes TP rank 0's proposal (module docstring). None: one rank.

    Raises:
        ValueError: for a head that cannot be resolved or read (after ``speculative_config
            model NAME:``), whose vocabulary or hidden size differs from the target's, or
            that leaves parameters unset.
    """

    def __init__(self, config: EngineConfig, backend: Any, dtype: torch.dtype,
                 device: torch.device, target: torch.nn.Module, target_vocab_size: int,
                 tp_group: CommGroup | None = None) -> None:
        spec, mc = config.speculative_config, config.model_config
        self.tp_group = tp_group
        with _naming_the_draft(spec.model):
            source = resolve_model(spec.model, mc.download_dir, token=mc.hf_token)
            hf_config = load_hf_config(source, trust_remote_code=mc.trust_remote_code)
        target_hidden = target.config.hidden_size
        if hf_config.vocab_size != target_vocab_size or hf_config.hidden_size != target_hidden:
            raise ValueError(f"speculative_config model {spec.model!r}: the {spec.method} head "
                             f"of vocabulary {hf_config.vocab_size} and hidden size "
                             f"{hf_config.hidden_size} does not fit the target's "
                             f"{target_vocab_size} and {target_hidden}")
        if spec.method != "deepseek_mtp":  # an MTP head is under the target's own config
            extend_head_positions(hf_config, target.config)
        self.attn_ctx = AttentionContext(backend)
        with _naming_the_draft(spec.model):
            self.vocab: HeadVocab | None = None
            self.taps: LayerTaps | None = None  # EAGLE-3: the target's layers it reads
            if spec.method == "deepseek_mtp":
                self.model = load_mtp(config, source, hf_config, self.attn_ctx, target, dtype,
                                      device)
            elif spec.method == "eagle3":
                self.model, self.vocab, self.taps = load_eagle3(
                    source.path, hf_config, self.attn_ctx, target, dtype, device)
            else:
                self.model = load_head(source.path, hf_config, self.attn_ctx,
                                       tensor_names(source.path), target, dtype, device)
        self.long_prompt_rope = long_prompt_rope(hf_config)
        self._init_passes(config, device)
        self.stash = FeatureStash(spec.num_speculative_tokens + 1)
        # the head's last outputs, fed back as the next draft's features: batch rows
        # (increasing) and their rows [len, H]
        self._fed_back: tuple[np.ndarray, torch.Tensor | None] = (np.zeros(0, np.int64), None)
        self._feeding_back = False
        self._slot_cache: tuple[tuple[int, int, bytes], np.ndarray] | None = None

    # ---- the target's features -----------------------------------------------------------------
    def observe_target(self, batch: InputBatch, inputs: ModelInputs, hidden: torch.Tensor,
                       block_size: int, stager: InputStager,
                       aux: list[torch.Tensor] | None = None) -> None:
        """Take the target's final hidden states of the step just run (``hidden``: [T', H]
        with T' >= the step's tokens, in ``inputs``' token order; EAGLE-3 uses instead ``fc``
        of its taps on the target's layers, ``aux`` [T', H] each, which the same forward
        returned). Call after each target forward. What the head will still read is kept (``FeatureStash``, at most k + 1 rows
        per request):

        - a row verifying drafts: all its rows (positions ``c .. c + k``); the next mirror
          pass reads those of the accepted tokens, the rest are overwritten;
        - a prompt chunk (no drafts; the prompt's tokens after its first known): the head
          reads it now (its K/V of the chunk's positions whose next token is known: all of a
          chunk the prompt goes on after, one token long too), and the chunk's last row is
          kept: the next step's mirror pass reads it again when that step computes the
          prompt's last token alone and verifies drafts after it (draft 1's logits);
        - a decode without drafts (adaptive lengths turned them off): only its row, which the
          head's first draft reads when drafting resumes (the positions in between keep no
          head K/V of their own: acceptance may drop after the gap, the output cannot).
        """
        if self.taps is not None:  # EAGLE-3: fc over the target's layer taps
            hidden = self.model.combine(self.taps.combine(aux))
        rows = inputs.rows
        if not len(rows):
            return
        qs = inputs.query_start
        q, c, num_tokens = qs[1:] - qs[:-1], batch.num_computed_tokens[rows], \
            batch.num_tokens[rows]
        drafts = np.maximum(c + q - num_tokens, 0)
        # a prompt chunk: tokens follow its first one (a decode's is the last token)
        prefill = (drafts == 0) & (c + 1 < num_tokens)
        # the rows with drafts, else the last row (a decode's, or a chunk's, which the mirror
        # reads again if the next step computes the prompt's last token alone with drafts)
        keep_from = np.where(drafts > 0, c, c + q - 1)
        eager = None
        if prefill.any():  # head token indices c + 1 .. c + eager: x[j] known, f[j - 1] here
            on_host = num_tokens - (batch.pending_sample[rows] >= 0)
            eager = np.where(prefill, np.maximum(np.minimum(c + q, on_host - 1) - c, 0), 0)
        slots = self._slots_of_rows(batch, rows, hidden)
        if eager is not None and eager.any():
            self._read_prompt(batch, rows, c, eager, qs[:-1], hidden, block_size, stager)
        self.stash.store(slots, keep_from, hidden, qs[:-1] + keep_from - c, c + q - keep_from)

    def _slots_of_rows(self, batch: InputBatch, rows: np.ndarray, like: torch.Tensor
                       ) -> np.ndarray:
        """The stash slots of batch rows ``rows`` (new requests get one), reused while the
        batch's rows and the step's rows stay those of the previous call."""
        key = (id(batch), batch.version, rows.tobytes())
        if self._slot_cache is None or self._slot_cache[0] != key:
            self._slot_cache = (key, self.stash.slots_of(
                [batch.req_ids[r] for r in rows.tolist()], like))
        return self._slot_cache[1]

    def release(self, batch: InputBatch) -> None:
        """Free the stash slots of the requests that left ``batch`` (finished, aborted or
        preempted); call after each step's changes are applied to it."""
        if self.stash.keep_only(batch.req_id_to_index):
            self._slot_cache = None

    def _read_prompt(self, batch: InputBatch, rows: np.ndarray, computed: np.ndarray,
                     count: np.ndarray, first_row: np.ndarray, hidden: torch.Tensor,
                     block_size: int, stager: InputStager) -> None:
        """One head pass over token indices ``computed[i] + 1 ..`` (``count[i]`` of them) of
        each row ``rows[i]``, fed the step's own features (``hidden`` rows ``first_row[i]
        ..``): the head's K/V of a prompt chunk, written in the blocks the step allocated."""
        n = batch.num_reqs
        query, start, source = (np.zeros(n, np.int64) for _ in range(3))
        query[rows], start[rows], source[rows] = count, computed + 1, first_row
        self.run_pass(batch, query, start, block_size, stager, None, np.zeros(0, np.int64),
                      source=(hidden, source))

    def _slots(self, batch: InputBatch, rows: np.ndarray) -> np.ndarray:
        """The stash slots of batch rows ``rows`` (int64 [R]).

        Raises:
            RuntimeError: for a row whose request has no target features (a bookkeeping
                error: every scheduled row is observed).
        """
        try:
            slots = np.fromiter((self.stash.slot[batch.req_ids[r]] for r in rows.tolist()),
                                np.int64, len(rows))
        except KeyError as e:
            raise RuntimeError(f"EAGLE: request {e} has no target features") from None
        if (self.stash.begin[slots] < 0).any():
            raise RuntimeError("EAGLE: a drafting request has no target features yet")
        return slots

    # ---- the passes (DraftModel's, with features) ----------------------------------------------
    def _mirror(self, batch: InputBatch, num_base: np.ndarray, drafting: np.ndarray,
                *args: Any, **kwargs: Any) -> list[float]:
        """DraftModel's mirror pass, from the first position with a target feature not yet
        fed to the head: the accepted drafts of the step before are computed again from the
        target's features, as vLLM's EAGLE proposer does (its own outputs fed them)."""
        slots = self._slots(batch, drafting)
        batch.num_draft_computed[drafting] = self.stash.begin[slots] + 1
        self._fed_back = (np.zeros(0, np.int64), None)
        steady = super()._mirror(batch, num_base, drafting, *args, **kwargs)
        # positions up to the last known token's are consumed
        self.stash.drop_before(slots, batch.num_draft_computed[drafting] - 1)
        return steady

    def _next_draft(self, *args: Any, **kwargs: Any) -> None:
        self._feeding_back = True
        try:
            super()._next_draft(*args, **kwargs)
        finally:
            self._feeding_back = False

    def run_pass(self, batch: InputBatch, query: np.ndarray, computed: np.ndarray,
                 block_size: int, stager: InputStager,
                 fill_pending: Callable[[ModelInputs], None] | None,
                 logits_rows: np.ndarray,
                 source: tuple[torch.Tensor, np.ndarray] | None = None) -> torch.Tensor | None:
        """One head forward over token indices ``computed[r] ..`` (``query[r]`` of them) of
        each row, at positions one lower (module docstring); keeps the outputs of
        ``logits_rows``' last tokens to feed back and returns their float32 logits
        [len(logits_rows), V] (None without ``logits_rows``). ``source``: the features
        ([T, H], and int64 [num_reqs] each row's first of them) instead of the stash's."""
        at = build_model_inputs(batch, query, block_size, stager, num_computed=computed - 1,
                                long_prompt_rope=self.long_prompt_rope)
        if source is None:
            ids = build_model_inputs(batch, query, block_size, stager, num_computed=computed)
            if fill_pending is not None and len(ids.pending_token_index):
                fill_pending(ids)
            input_ids = ids.input_ids
        else:  # a prompt chunk's tokens, all on the host (the last may lie past its blocks)
            token_rows = np.repeat(at.rows, query[at.rows])
            index = np.repeat(computed[at.rows], query[at.rows]) + ramp(query[at.rows])
            input_ids = torch.from_numpy(batch.token_ids[token_rows, index]).to(
                at.input_ids.device)
        features = self._features(batch, at.rows, computed, query, source)
        metadata = at.attn_metadata[:1]
        with self.attn_ctx.forward_context.bind(metadata):
            self.attn_ctx.backend.prepare(metadata[0], block_size)
            hidden = self.model(input_ids, at.positions, features)
        if not len(logits_rows):
            return None
        last = at.query_start[1:][np.searchsorted(at.rows, logits_rows)] - 1
        hidden = hidden[torch.from_numpy(last).to(hidden.device)]
        self._keep_fed_back(logits_rows, hidden)
        if self.vocab is not None:  # EAGLE-3's own vocabulary: columns self.vocab.token_ids
            return self.vocab.logits(hidden)
        return self.model.compute_logits(hidden)

    def _keep_fed_back(self, rows: np.ndarray, hidden: torch.Tensor) -> None:
        """Keep the head's outputs ``hidden`` [R, H] of batch rows ``rows``: they replace
        those kept (a draft pass), or join them (the mirror's passes, one per chunk of
        catch-up tokens, each ending some rows)."""
        kept_rows, kept = self._fed_back
        if self._feeding_back or kept is None:
            self._fed_back = (rows, hidden)
            return
        rows = np.concatenate([kept_rows, rows])
        order = np.argsort(rows, kind="stable")
        self._fed_back = (rows[order], torch.cat([kept, hidden])[
            torch.from_numpy(order).to(hidden.device)])

    def _features(self, batch: InputBatch, rows: np.ndarray, computed: np.ndarray,
                  query: np.ndarray,
                  source: tuple[torch.Tensor, np.ndarray] | None = None) -> torch.Tensor:
        """[T, H]: for token index ``j`` of each of the pass's rows ``rows`` (increasing),
        the target's feature at ``j - 1`` (mirror passes: the stash's; a prompt chunk:
        ``source``'s) or the head's last output for the row (draft passes, one token per
        row). One index select each."""
        if self._feeding_back:
            kept_rows, kept = self._fed_back
            index = np.searchsorted(kept_rows, rows)
            return kept.index_select(0, torch.from_numpy(index).to(kept.device))
        if source is not None:
            hidden, first_row = source
            src = np.repeat(first_row[rows], query[rows]) + ramp(query[rows])
            return hidden.index_select(0, torch.from_numpy(src).to(hidden.device))
        return self.stash.take(self._slots(batch, rows), computed[rows] - 1, query[rows])
