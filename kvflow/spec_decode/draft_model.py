"""A draft model proposing speculative tokens inside the target's model runner.

The draft model (``{"method": "draft_model", "model": NAME}``: a smaller model sharing the
target's tokenizer and vocabulary) keeps its own paged KV cache in the target's block pool: its
layers' tensors are indexed by the target's group-0 block ids (``KVCacheConfig.draft_group``),
so a block id holds both models' K/V of the same tokens and one block's bytes count both.

The draft's K/V is computed lazily, only for the requests that draft: ``InputBatch.
num_draft_computed`` counts the positions of a row whose draft K/V is in place. A step that
verifies ``k`` drafts of a request first runs the "mirror" pass: the draft computes that
request's tokens from ``num_draft_computed`` to its last known token (one or two tokens when
it drafted the step before; the whole context when it starts drafting, in passes of at most
``max_num_batched_tokens`` tokens), and its last logits give draft 1; ``k - 1`` more passes of
one token per drafting request give drafts 2..k, writing the draft's K/V of drafts 1..k-1 (at
positions ``num_tokens .. num_tokens + k - 2``, inside the blocks the scheduler allocated for
the step). After verification ``InputBatch.accept_tokens`` cuts ``num_draft_computed`` to the
accepted prefix. A step without drafts runs no draft pass at all, so when adaptive lengths turn
speculation off (a large batch) the draft costs nothing; the price is that a new request (or a
prefix-cache hit, or a request resumed after recompute preemption) starts with no draft K/V
(``num_draft_computed = 0``: a cached block may have been filled while nobody drafted) and the
draft recomputes its context when it first drafts. A request swapped out and back in
(``--preemption-mode swap``) got the draft's K/V back with the target's, and resumes with
the count it had (``RequestState.draft_kv_tokens``).

With tensor parallelism every rank holds the whole draft (unsharded) and proposes; the ranks
then take TP rank 0's tokens and ``q`` (``share_proposal``), so they verify the same drafts.

On a CPU the draft's passes run on their own thread count (``draft_threads.py``): the faster,
as measured, of the engine's count and one thread, unless ``draft_cpu_threads`` fixes it.

Draft tokens are chosen from each pass's last logits in draft_choice.py: the argmax for
greedy requests, else a draw from ``q`` (the request's sampling truncation applied), which goes
to the rejection sampler with the tokens.

Constrained requests (structured output): the grammar lives in the engine core, which hands the
step its first grammar row per constrained request (what may follow the request's tokens); draft
1 is chosen within it (argmax or ``q`` over the allowed tokens), so it is never one the grammar
rejects. Before each later draft ``i`` the draft asks the core (``DraftGrammar``: a call in
process, a ``rows?`` / ``rows`` message pair with a worker process) for the rows after drafts
``1..i-1`` and chooses draft ``i`` within them, so a draft is a token the grammar accepts after
the drafts before it (but where a cut vocabulary holds no allowed token, or after the
grammar's end); the core fills the verification's rows after them (``core/engine_steps.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from kvflow.attention.layer import Attention, AttentionContext
from kvflow.config import EngineConfig
from kvflow.distributed.comm import CommGroup
from kvflow.kv_cache_interface import DRAFT_LAYER_PREFIX, KVCacheGroupSpec, KVCacheSpec
from kvflow.layers.rotary import long_prompt_rope
from kvflow.models.generation_config import load_eos_token_ids
from kvflow.models.loader import load_hf_config, load_model
from kvflow.models.model_resolver import resolve_model
from kvflow.quant import get_quant_config
from kvflow.sched_output import DraftGrammar, GrammarBitmask
from kvflow.spec_decode.draft_choice import choose_drafts, later_grammar_rows, mask_drafts
from kvflow.spec_decode.draft_proposal import DraftProposal, share_proposal
from kvflow.spec_decode.draft_threads import DraftThreads
from kvflow.spec_decode.draft_vocab import DraftVocab
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.model_inputs import InputStager, ModelInputs, build_model_inputs


@contextmanager
def _naming_the_draft(model: str) -> Iterator[None]:
    """Within the block, a ``ValueError`` (from resolving, reading or loading the draft) says
    it is about the draft: a checkpoint-tensor error of the loader names the tensor only, which
    read as the target's."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"speculative_config model {model!r}: {e}") from None


class DraftModel:
    """The draft model, its attention context and KV tensors, on the target's device.

    Args:
        config: the engine config (``speculative_config.model`` names the draft).
        backend: an attention backend instance for the draft's layers (not the target's: a
            backend keeps per-step state).
        dtype / device: the target's compute dtype and device.
        target_vocab_size: rows of the target's logits; the draft must have as many.
        target_end_ids: the target's declared EOS ids (``load_eos_token_ids``: its
            generation_config.json's ``eos_token_id``, else its config's), kept in a cut LM
            head beside the draft's own end tokens (read the same way from the draft's
            folder or GGUF file); ids outside the vocabulary are skipped.
        tp_group: the target's tensor-parallel group: every rank holds the whole draft and
            proposes, then takes TP rank 0's proposal (``share_proposal``), so the ranks
            verify the same drafts even where their draft passes round differently (another
            thread count). None: one rank.

    Raises:
        ValueError: for a draft whose vocabulary size differs from the target's, or one that
            cannot be resolved or loaded (the loader's message, after
            ``speculative_config model NAME:``).
    """

    def __init__(self, config: EngineConfig, backend: Any, dtype: torch.dtype,
                 device: torch.device, target_vocab_size: int,
                 target_end_ids: Iterable[int] = (), tp_group: CommGroup | None = None
                 ) -> None:
        spec = config.speculative_config
        self.tp_group = tp_group
        mc = config.model_config
        with _naming_the_draft(spec.model):
            source = resolve_model(spec.model, mc.download_dir, token=mc.hf_token)
            hf_config = load_hf_config(source, trust_remote_code=mc.trust_remote_code)
        if hf_config.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config model {spec.model!r} has a vocabulary of "
                             f"{hf_config.vocab_size} tokens, the target {target_vocab_size}; "
                             "a draft model must share the target's tokenizer")
        self.attn_ctx = AttentionContext(backend)
        quantization, vocab_size = spec.draft_options(  # "auto" resolved
            device.type, getattr(hf_config, "quantization_config", None) is not None,
            config.device_config.deterministic)
        with _naming_the_draft(spec.model):
            quant = get_quant_config(quantization, hf_config, source.kind,
                                     mc.quantization_group_size)
            self.long_prompt_rope = long_prompt_rope(hf_config)
            self.model = load_model(source, hf_config, self.attn_ctx, dtype, device,
                                    mc.load_format, mc.seed, quant)
        # FR-Spec: the head cut to frequent tokens (before the runner packs it), keeping the
        # end tokens of both models: a base-model draft ends text with another token than an
        # instruct target, whose end the draft must be able to propose
        end_ids = [t for t in [*load_eos_token_ids(source, hf_config), *target_end_ids]
                   if 0 <= t < hf_config.vocab_size]
        self.vocab = DraftVocab(self.model, vocab_size, end_ids) \
            if vocab_size and vocab_size < hf_config.vocab_size else None
        self._init_passes(config, device)

    def _init_passes(self, config: EngineConfig, device: torch.device) -> None:
        """What the passes read, once ``self.model`` is loaded (a draft model's and an EAGLE
        head's alike): the attention layers by their KV-spec names (``DRAFT_LAYER_PREFIX`` +
        layer name), the device, the CPU thread count (``draft_cpu_threads``, else the faster
        of the engine's and 1) and the most tokens of one catch-up mirror pass (a target
        step's ``max_num_batched_tokens``)."""
        self.attn_layers = {DRAFT_LAYER_PREFIX + name: m for name, m in
                            self.model.named_modules() if isinstance(m, Attention)}
        self.device = device
        engine_threads = torch.get_num_threads()
        fixed = config.speculative_config.draft_cpu_threads if device.type == "cpu" \
            else engine_threads
        self.threads = DraftThreads([fixed] if fixed else [engine_threads, 1])
        self.max_tokens_per_pass = config.scheduler_config.max_num_batched_tokens or 2048

    # ---- KV cache ----------------------------------------------------------------------------
    def kv_cache_spec(self, block_size: int, dtype: torch.dtype,
                      scale_dtype: torch.dtype | None) -> dict[str, KVCacheSpec]:
        """The draft's layers' specs, named ``DRAFT_LAYER_PREFIX + layer name``."""
        return {name: layer.kv_cache_spec(block_size, dtype, scale_dtype)
                for name, layer in self.attn_layers.items()}

    def bind_kv_cache(self, group: KVCacheGroupSpec, num_blocks: int) -> list[torch.Tensor]:
        """Allocate one zeroed tensor per draft layer (``group.kv_cache_spec``'s shape, with
        scales for a quantized cache) and bind it; every draft layer reads group 0's block
        table. Returns the tensors."""
        spec, out = group.kv_cache_spec, []
        for name in group.layer_names:
            layer = self.attn_layers[name]
            layer.kv_cache = torch.zeros(spec.kv_cache_shape(num_blocks), dtype=spec.dtype,
                                         device=self.device)
            layer.kv_group = 0
            scales_shape = spec.kv_scales_shape(num_blocks)
            if scales_shape is not None:
                layer.kv_scales = torch.zeros(scales_shape, dtype=spec.scale_dtype,
                                              device=self.device)
            out.append(layer.kv_cache)
        return out

    def release_kv_cache(self) -> None:
        """Unbind the draft's KV tensors."""
        for layer in self.attn_layers.values():
            layer.kv_cache, layer.kv_scales = torch.empty(0), None

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: InputBatch, num_scheduled: np.ndarray,
                spec_tokens: dict[str, list[int]], block_size: int, stager: InputStager,
                fill_pending: Callable[[ModelInputs], None],
                generator: torch.Generator,
                first_grammar: GrammarBitmask | None = None,
                draft_grammar: DraftGrammar | None = None) -> DraftProposal:
        """Run the mirror pass of the drafting requests, then propose their tokens (module
        docstring).

        Args:
            batch: the persistent batch, this step's changes applied.
            num_scheduled: int64 [batch.num_reqs], tokens each row computes this step (drafts
                included).
            spec_tokens: request id -> its scheduled drafts (placeholders: only the count is
                read).
            block_size: tokens per KV block.
            stager / fill_pending: the runner's input stager, and what writes tokens still on
                the device (the previous step's samples) into a pass's input ids.
            generator: for unseeded sampled requests.
            first_grammar: one bitmask row per constrained request (its grammar's row before
                draft 1, which is chosen within it), or None.
            draft_grammar: asked, before each later draft ``i``, for the rows after the
                constrained requests' drafts ``1..i-1`` (draft ``i`` is chosen within them),
                or None (the later drafts unmasked). Called as often on every TP rank.
        """
        threads = self.threads.pick()
        with self.threads.running(threads):
            proposal = self._propose(batch, num_scheduled, spec_tokens, block_size, stager,
                                     fill_pending, generator, first_grammar, draft_grammar)
        self.threads.observe(proposal.pass_seconds)
        proposal.threads = threads
        if not self.threads.picked_best:  # a pass on a slower count is not the draft's cost
            proposal.pass_seconds = 0.0
        if self.tp_group is not None and self.tp_group.world_size > 1:
            share_proposal(proposal, self.tp_group)
        return proposal

    def _propose(self, batch: InputBatch, num_scheduled: np.ndarray,
                 spec_tokens: dict[str, list[int]], block_size: int, stager: InputStager,
                 fill_pending: Callable[[ModelInputs], None], generator: torch.Generator,
                 first_grammar: GrammarBitmask | None,
                 draft_grammar: DraftGrammar | None) -> DraftProposal:
        started = time.perf_counter()
        n = batch.num_reqs
        num_drafts = np.zeros(n, np.int64)
        for rid, tokens in spec_tokens.items():
            num_drafts[batch.req_id_to_index[rid]] = len(tokens)
        drafting = np.flatnonzero(num_drafts)
        tokens = np.zeros((len(drafting), int(num_drafts.max(initial=0))), np.int64)
        probs: list[list[torch.Tensor]] = [[] for _ in drafting]
        if not len(drafting):
            return DraftProposal({}, {}, 0.0)
        if self.vocab is not None:  # the context's tokens and the ids that end each request
            self.vocab.update(batch.token_ids, batch.num_tokens, drafting,
                              [batch.stop_ids.get(batch.req_ids[r], ()) for r in drafting])
        steady = self._mirror(batch, num_scheduled - num_drafts, drafting, block_size, stager,
                              fill_pending, generator, tokens, probs, first_grammar)
        constrained = set(first_grammar.request_ids) \
            if first_grammar is not None and draft_grammar is not None else set()
        for i in range(1, tokens.shape[1]):
            passed = time.perf_counter()
            grammar = later_grammar_rows(batch, drafting, num_drafts, tokens, i, constrained,
                                         draft_grammar)
            self._next_draft(batch, num_drafts, drafting, i, block_size, stager, generator,
                             tokens, probs, grammar)
            steady.append(time.perf_counter() - passed)
        proposal = DraftProposal({}, {}, 0.0)
        for j, row in enumerate(drafting.tolist()):
            rid = batch.req_ids[row]
            proposal.token_ids[rid] = tokens[j, :num_drafts[row]].tolist()
            if probs[j]:
                proposal.probs[rid] = torch.stack(probs[j])
        proposal.seconds = time.perf_counter() - started
        proposal.pass_seconds = float(np.mean(steady)) if steady else 0.0
        return proposal

    def _mirror(self, batch: InputBatch, num_base: np.ndarray, drafting: np.ndarray,
                block_size: int, stager: InputStager,
                fill_pending: Callable[[ModelInputs], None], generator: torch.Generator,
                tokens: np.ndarray, probs: list[list[torch.Tensor]],
                first_grammar: GrammarBitmask | None = None) -> list[float]:
        """Catch the drafting rows' draft K/V up to their last known token, in passes of at
        most ``max_tokens_per_pass`` tokens, and choose draft 1 from each row's last logits
        (within ``first_grammar``'s row for a constrained request).
        ``num_base``: int64 [num_reqs], each row's scheduled tokens without its drafts.
        Returns the seconds of the pass when it was steady (at most 2 tokens per row)."""
        n = batch.num_reqs
        end = batch.num_computed_tokens[:n] + num_base
        computed = np.minimum(batch.num_draft_computed[:n], end)
        computed[drafting] = np.minimum(computed[drafting], end[drafting] - 1)  # draft 1's logits
        left = np.zeros(n, np.int64)
        left[drafting] = end[drafting] - computed[drafting]
        steady = bool(left.max(initial=0) <= 2)
        while left.any():
            query = np.minimum(left, np.maximum(self.max_tokens_per_pass -
                                                (np.cumsum(left) - left), 0))
            done = drafting[(left[drafting] == query[drafting]) & (query[drafting] > 0)]
            passed = time.perf_counter()
            logits = self.run_pass(batch, query, computed, block_size, stager, fill_pending, done)
            computed += query
            left -= query
            sub = np.searchsorted(drafting, done)
            if first_grammar is not None:
                mask_drafts(batch, done, logits, first_grammar, self.vocab)
            choose_drafts(batch, done, logits, 0, tokens, probs, generator, self.vocab, sub)
        batch.num_draft_computed[drafting] = end[drafting]
        return [time.perf_counter() - passed] if steady else []

    def _next_draft(self, batch: InputBatch, num_drafts: np.ndarray, drafting: np.ndarray,
                    i: int, block_size: int, stager: InputStager,
                    generator: torch.Generator, tokens: np.ndarray,
                    probs: list[list[torch.Tensor]],
                    grammar: GrammarBitmask | None = None) -> None:
        """Draft ``i`` (0-based) of the rows drafting more than ``i`` tokens: one token each,
        draft ``i - 1`` at position ``num_tokens + i - 1``; a constrained row's within its
        row of ``grammar`` (what its grammar allows after drafts ``0..i-1``)."""
        n = batch.num_reqs
        rows = drafting[num_drafts[drafting] > i]
        sub = np.flatnonzero(num_drafts[drafting] > i)
        position = batch.num_tokens[rows] + i - 1
        for row, j in zip(rows.tolist(), sub.tolist()):  # drafts 1..i after the tokens
            batch.write_draft_tokens(row, tokens[j, :i])
        query = np.zeros(n, np.int64)
        query[rows] = 1
        computed = batch.num_draft_computed[:n].copy()
        computed[rows] = position
        logits = self.run_pass(batch, query, computed, block_size, stager, None, rows)
        batch.num_draft_computed[rows] = position + 1
        if grammar is not None:
            mask_drafts(batch, rows, logits, grammar, self.vocab)
        choose_drafts(batch, rows, logits, i, tokens, probs, generator, self.vocab, sub)

    def run_pass(self, batch: InputBatch, query: np.ndarray, computed: np.ndarray,
              block_size: int, stager: InputStager,
              fill_pending: Callable[[ModelInputs], None] | None,
              logits_rows: np.ndarray) -> torch.Tensor:
        """One draft forward over ``query[r]`` tokens of each row from ``computed[r]``;
        returns the float32 logits [len(logits_rows), V] of those rows' last tokens."""
        inputs = build_model_inputs(batch, query, block_size, stager, num_computed=computed,
                                    long_prompt_rope=self.long_prompt_rope)
        if fill_pending is not None and len(inputs.pending_token_index):
            fill_pending(inputs)
        metadata = inputs.attn_metadata[:1]
        with self.attn_ctx.forward_context.bind(metadata):
            self.attn_ctx.backend.prepare(metadata[0], block_size)
            hidden = self.model(inputs.input_ids, inputs.positions)
        last = inputs.query_start[1:][np.searchsorted(inputs.rows, logits_rows)] - 1
        hidden = hidden[torch.from_numpy(last).to(hidden.device)]
        if self.vocab is not None:  # columns: self.vocab.token_ids
            return self.vocab.logits(hidden)
        return self.model.compute_logits(hidden)
