"""What the scheduler hands the model runners each step (pure data: no engine imports).

The runner keeps the state of every request it computes (a persistent input batch), so a step
sends only what changed since the previous one (the pattern of vLLM v1's
``core/sched/output.py``):

* ``NewRequestData``: a request the runner has not seen, sent whole once (prompt, sampling
  parameters, block tables, computed count);
* ``CachedRequestData``: for every other scheduled request its new computed count and, only
  for those concerned, the block ids appended to each KV-cache group's table since the last
  step (the whole tables when it resumes after a preemption) and tokens the runner cannot know
  (see below);
* the tokens scheduled per request, and the requests preempted / finished since the last step;
* speculative decoding: the draft tokens each request verifies this step, and the block tables
  cut back after an earlier step's rejected drafts.
* KV blocks to copy to host memory (a request swapped out) and back (swapped in), which the
  runner copies before the step's forward pass (``--preemption-mode swap``).
* a KV connector's blocks to load from storage before the forward pass and to save after it
  (``--kv-transfer-config``, ``kvflow/kv_connector_meta.py``).

The runner appends the tokens it samples itself, so a decode step carries no token ids. A
runner forgets a preempted request's generated tokens (its K/V are gone too); when the request
resumes, ``CachedRequestData.new_token_ids`` carries them back. A scheduler built with
``send_token_ids`` (for runners that do not sample, e.g. the pipeline-parallel ranks before the
last) also sends every step's computed tokens.

Every message is plain data (lists, dicts, tuples, dataclasses and ``SamplingParams``), so one
broadcast to several runner processes encodes with msgspec; ``GrammarBitmask`` is the only one
that carries a tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvflow.inputs.embeds import PromptEmbeds
from kvflow.inputs.multimodal import MultiModalFeature
from kvflow.kv_connector_meta import KVConnectorMetadata
from kvflow.lora.request import LoRARequest
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams

# One block-id list per KV-cache group.
BlockIds = tuple[list[int], ...]


@dataclass
class NewRequestData:
    """A request scheduled for the first time: everything the runner keeps about it.

    Attributes:
        req_id: the request id (one sample of an ``n > 1`` request has its own).
        prompt_token_ids: the prompt.
        sampling_params: its sampling parameters (``n`` already fanned out).
        eos_token_id: the model's EOS id (banned until ``min_tokens``), or None.
        block_ids: its block table in every KV-cache group (equally long; entries a sliding
            window no longer reads are the null block 0).
        num_computed_tokens: tokens whose K/V are already cached (prefix-cache hits).
        mm_features: the prompt's images (pixels, placeholder ranges), None if text only;
            the runner keeps them until the request finishes (a preempted request may need
            its images encoded again).
        lora_request: its LoRA adapter (None: the base model).
        pooling_params: set for an embedding request (pooled when its prompt is computed,
            nothing sampled).
        prompt_embeds: the prompt's embedding rows when it was given as embeddings (its
            ``prompt_token_ids`` are placeholders); the runner keeps them until the request
            finishes (a preempted request computes its prompt again).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: BlockIds
    num_computed_tokens: int
    mm_features: list[MultiModalFeature] | None = None
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None
    prompt_embeds: PromptEmbeds | None = None


@dataclass
class CachedRequestData:
    """What changed for the scheduled requests the runner already holds: every one's computed
    count, and sparse maps for the few that have more (a decode step usually has none).

    Attributes:
        req_ids: the requests, in scheduling order.
        num_computed_tokens: tokens whose K/V are cached before this step, one per request.
        new_block_ids: request id -> the block ids appended to each group's table since the
            last step (only requests that got blocks); for a resumed request, its whole tables.
        new_token_ids: request id -> tokens the runner cannot know: for a resumed request all
            its generated tokens; with ``send_token_ids``, the tokens computed this step
            (positions ``num_computed_tokens`` on).
        resumed_req_ids: requests readmitted after a preemption (the runner dropped their
            rows and generated tokens when they were preempted).
    """

    req_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    new_block_ids: dict[str, BlockIds] = field(default_factory=dict)
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)
    resumed_req_ids: set[str] = field(default_factory=set)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step's work.

    A scheduled request's step computes ``num_scheduled_tokens[req_id]`` tokens from position
    ``num_computed_tokens`` on; the last ``len(scheduled_spec_decode_tokens[req_id])`` of them
    are draft tokens to verify (speculative decoding). It samples when the step reaches the
    end of the tokens the runner holds for it (prompt + sampled).

    Attributes:
        scheduled_new_reqs: requests sent whole (first time scheduled).
        scheduled_cached_reqs: the changes of the other scheduled requests.
        num_scheduled_tokens: request id -> tokens computed this step (every scheduled request).
        total_num_scheduled_tokens: their sum.
        scheduled_spec_decode_tokens: request id -> draft tokens scheduled for verification
            (empty without speculative decoding), the last of the request's scheduled tokens.
            Ids proposed by the engine core (n-gram) are given; ``-1`` entries are proposed by
            the runner's draft model at the start of the step.
        truncated_block_tables: request id -> its block tables' length (blocks, every group)
            after an earlier step's rejected draft tokens were rolled back and the blocks
            holding only them freed; runners cut their tables to it before appending this
            step's new block ids.
        structured_output_request_ids: constrained requests that sample this step (their
            grammar bitmask rows are filled just before sampling).
        preempted_ids: requests preempted this step (runners drop their rows and tokens).
        finished_ids: requests freed since the previous step (runners drop all their state).
        scheduled_encoder_inputs: request id -> indices into its ``mm_features`` of the
            images to run the vision encoder on this step (before the forward pass).
        free_encoder_mm_hashes: image identifiers to drop from the runners' encoder caches
            (before this step's encoder runs).
        blocks_to_swap_out: (device block id, host block id) pairs to copy device -> host
            first (the device blocks may be reused by this step's writes).
        blocks_to_swap_in: (host block id, device block id) pairs to copy host -> device
            next, before the forward pass.
        kv_connector_metadata: the KV connector's loads (before the forward pass) and saves
            (after it) this step (``--kv-transfer-config``); None without a connector.
        step_index: the scheduler's count of the steps it scheduled, this one included (the
            scheduler tells the outputs of a request freed while its step was in flight from
            those of a new request that took its id; runners ignore it).
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    truncated_block_tables: dict[str, int] = field(default_factory=dict)
    structured_output_request_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: set[str] = field(default_factory=set)
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    kv_connector_metadata: KVConnectorMetadata | None = None
    step_index: int = 0

    @property
    def num_scheduled_reqs(self) -> int:
        return len(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    @property
    def changes_runners(self) -> bool:
        """Whether the runners must see this step even when it schedules no token: requests
        to drop (finished, preempted), blocks to swap, tables to cut or encoder entries to
        free (a pipeline's empty micro-batch that said none of these is not sent)."""
        return bool(self.finished_ids or self.preempted_ids or self.blocks_to_swap_out or
                    self.blocks_to_swap_in or self.truncated_block_tables or
                    self.free_encoder_mm_hashes)


@dataclass
class GrammarBitmask:
    """The allowed tokens of one step's constrained rows.

    Attributes:
        request_ids: the constrained requests that sample this step, one entry per bitmask
            row: a request verifying ``k`` draft tokens has ``k + 1`` consecutive rows, row
            ``i`` allowing what may follow its first ``i`` drafts (nothing once one of them
            is a token the grammar rejects).
        bitmask: int32 [len(request_ids), ceil(vocab_size / 32)], CPU; bit ``t % 32`` of word
            ``t // 32`` set means token ``t`` is allowed (xgrammar's layout).
    """

    request_ids: list[str]
    bitmask: torch.Tensor


# A draft model's grammar rows for its next draft (drafts 2..k of constrained requests): given
# each constrained drafting request's drafts so far (request id -> tokens), one row per
# request, what its grammar allows after its tokens and those drafts (nothing after a draft
# it rejects); None when there is none. The engine core answers it (the grammar lives there).
DraftGrammar = Callable[[dict[str, list[int]]], "GrammarBitmask | None"]
