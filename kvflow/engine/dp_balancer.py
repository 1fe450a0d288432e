"""Which data-parallel replica a request goes to: prefix-cache affinity, bounded by queue depth.

Each replica (engine core) has its own KV cache and prefix cache, so a request whose prompt
starts like an earlier one's is cheapest where that one ran: its first blocks are cached
there. Sending every such request to the same replica can overload it, though, so affinity
yields to load once the preferred replica is much deeper than the least-loaded one.

The rule (``DPLoadBalancer.choose``):

1. *Depth* of a replica: the samples it was given that have not finished (a request with
   ``n`` samples counts ``n``), counted in the API process when a request is sent and when it
   finishes or is aborted, so it is exact and never lags behind the replica's own reports.
2. *Preferred* replica: the prompt's first ``affinity_blocks`` full KV blocks
   (``block_size`` token ids each; a shorter prompt has fewer, one under a block has none)
   give a chain of prefix hashes (block ``i``'s hash covers blocks ``0..i``, as the prefix
   cache's do; the chain starts from the request's ``cache_key``, its LoRA adapter,
   ``cache_salt`` and prompt embeddings, and a block mixes in the images whose placeholders
   it holds: the prefix cache keys its blocks by them too, so a prompt under another adapter
   or salt, or with other embeddings or images behind the same placeholder ids, which cannot
   hit those blocks, is not drawn to their replica). The
   longest of them that a recent request was sent with names the preferred replica (an LRU
   map of ``max_entries`` prefixes).
3. The preferred replica is taken when it is alive, its known prefix covers at least
   ``min_shared_fraction`` of the tokens the balancer looks at (the prompt's first
   ``affinity_blocks * block_size``, or all of a shorter prompt), and
   ``depth[preferred] <= depth[least] + max(slack, slack_ratio * depth[least])``, where
   ``least`` is the live replica of smallest depth; among replicas of equal depth, the one
   whose KV cache is least used (``kv_cache_usage`` from its latest ``EngineStats``: its
   sequences are shorter), then the lowest index. Otherwise, or without a preferred replica,
   ``least`` is. The share rule is SGLang's cache-aware router's ``cache_threshold``
   (there of the whole prompt): a chat template's opening (its default system prompt, the
   first block of every chat prompt) is a short share of each prompt; it made every chat
   request follow the first one's replica until the slack was used up (8 concurrent chat
   requests on 2 replicas went 5/3), for a cache gain of one block per request that the
   other replica would lose once.
4. The prompt's prefix hashes are then recorded for the chosen replica, so the next request
   sharing them follows it.

Pure bookkeeping, no I/O: the API process (``AsyncLLM``) calls it on the event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.inputs.embeds import PromptEmbeds
    from kvflow.inputs.multimodal import MultiModalFeature
    from kvflow.request import Request


class DPLoadBalancer:
    """Chooses a replica per request and tracks each replica's depth (unfinished samples).

    Args:
        num_replicas: data-parallel replicas (``data_parallel_size``).
        block_size: tokens per KV block (the prefix cache's unit).
        affinity_blocks: leading full blocks of a prompt that name its preferred replica.
        slack / slack_ratio: how much deeper than the least-loaded live replica the preferred
            one may be (samples; fraction of the least depth; the larger of the two applies).
        max_entries: prefixes remembered (least recently used forgotten first).
        min_shared_fraction: the share (0-1) of the prompt's first ``affinity_blocks *
            block_size`` tokens that a known prefix must cover to name a preferred replica.

    Raises:
        ValueError: from the constructor for a non-positive replica count, block size or
            ``affinity_blocks``, a negative slack, or ``min_shared_fraction`` outside [0, 1].
    """

    def __init__(self, num_replicas: int, block_size: int, affinity_blocks: int = 4,
                 slack: int = 4, slack_ratio: float = 0.5, max_entries: int = 65536,
                 min_shared_fraction: float = 0.5) -> None:
        if num_replicas < 1 or block_size < 1 or affinity_blocks < 1:
            raise ValueError(f"DPLoadBalancer needs positive num_replicas ({num_replicas}), "
                             f"block_size ({block_size}) and affinity_blocks "
                             f"({affinity_blocks})")
        if slack < 0 or slack_ratio < 0:
            raise ValueError(f"slack={slack} and slack_ratio={slack_ratio} must be >= 0")
        if not 0 <= min_shared_fraction <= 1:
            raise ValueError(f"min_shared_fraction={min_shared_fraction} must be in [0, 1]")
        self.num_replicas, self.block_size = num_replicas, block_size
        self.affinity_blocks, self.min_shared_fraction = affinity_blocks, min_shared_fraction
        self.slack, self.slack_ratio, self.max_entries = slack, slack_ratio, max_entries
        self.depth = [0] * num_replicas
        self._prefix_owner: OrderedDict[int, int] = OrderedDict()
        self._requests: dict[str, tuple[int, int]] = {}  # request id -> (replica, samples)

    def prefix_hashes(self, prompt_token_ids: Sequence[int], cache_key: Hashable = None,
                      mm_features: Sequence[MultiModalFeature] | None = None) -> list[int]:
        """Hashes of the prompt's first 1, 2, ... ``affinity_blocks`` full blocks (each covers
        every block before it and ``cache_key``: see :func:`cache_key`; a block also covers
        the ``mm_features`` whose placeholders it holds, by identifier and offset in the
        block, as the prefix cache's block hashes do), shortest first; empty for a prompt
        under one block."""
        bs, out = self.block_size, []
        parent = 0 if cache_key is None else hash(("cache_key", cache_key))
        full = min(len(prompt_token_ids) // bs, self.affinity_blocks)
        for i in range(full):
            start, end = i * bs, (i + 1) * bs
            images = tuple((f.identifier, f.offset - start) for f in mm_features or ()
                           if f.offset < end and f.offset + f.length > start)
            block = tuple(prompt_token_ids[start:end])
            parent = hash((parent, block, images) if images else (parent, block))
            out.append(parent)
        return out

    def preferred(self, hashes: Sequence[int], num_prompt_tokens: int | None = None
                  ) -> int | None:
        """The replica recorded for the longest known prefix among ``hashes``, or None (also
        when ``num_prompt_tokens`` is given and that prefix covers less than
        ``min_shared_fraction`` of the prompt's first ``affinity_blocks`` blocks)."""
        for i in range(len(hashes) - 1, -1, -1):
            replica = self._prefix_owner.get(hashes[i])
            if replica is not None:
                break
        else:
            return None
        if num_prompt_tokens is not None:
            seen = min(num_prompt_tokens, self.affinity_blocks * self.block_size)
            if (i + 1) * self.block_size < self.min_shared_fraction * seen:
                return None
        return replica

    def choose_for(self, request: Request, live: Sequence[bool],
                   kv_usage: Sequence[float] | None = None,
                   data_parallel_rank: int | None = None) -> int:
        """:meth:`choose` for ``request`` (the first sample of a prompt): its prompt token
        ids, images and :func:`cache_key`.

        Raises:
            ValueError / RuntimeError: as :meth:`choose`.
        """
        return self.choose(request.prompt_token_ids, live, kv_usage,
                           cache_key(request.lora_request, request.cache_salt,
                                     request.prompt_embeds),
                           data_parallel_rank, request.mm_features)

    def choose(self, prompt_token_ids: Sequence[int], live: Sequence[bool],
               kv_usage: Sequence[float] | None = None, cache_key: Hashable = None,
               data_parallel_rank: int | None = None,
               mm_features: Sequence[MultiModalFeature] | None = None) -> int:
        """The replica for a new request (see the module's rule); records its prefixes there.

        Args:
            prompt_token_ids: the prompt.
            live: per replica, whether it takes requests now.
            kv_usage: per replica, the fraction of its KV blocks in use (0-1) as it last
                reported; breaks ties of depth (None: all equal).
            cache_key: what else the prefix cache keys the prompt's blocks by
                (:func:`cache_key` of the request; None: nothing, the base model unsalted).
            data_parallel_rank: the replica the caller pinned the request to (vLLM's
                ``data_parallel_rank``: the rule is skipped); None: the rule chooses.
            mm_features: the prompt's images (placeholders expanded in its token ids).

        Raises:
            ValueError: for a ``data_parallel_rank`` outside ``[0, num_replicas)``.
            RuntimeError: when no replica is live, or the pinned one is not.
        """
        hashes = self.prefix_hashes(prompt_token_ids, cache_key, mm_features)
        if data_parallel_rank is not None:
            return self._pinned(hashes, live, data_parallel_rank)
        candidates = [r for r in range(self.num_replicas) if live[r]]
        if not candidates:
            raise RuntimeError("no data-parallel replica is running")
        kv = kv_usage if kv_usage is not None else [0.0] * self.num_replicas
        least = min(candidates, key=lambda r: (self.depth[r], kv[r], r))
        chosen, pref = least, self.preferred(hashes, len(prompt_token_ids))
        if pref is not None and live[pref]:
            allowance = max(self.slack, self.slack_ratio * self.depth[least])
            if self.depth[pref] <= self.depth[least] + allowance:
                chosen = pref
        self._record(hashes, chosen)
        return chosen

    def _pinned(self, hashes: Sequence[int], live: Sequence[bool], rank: int) -> int:
        """``rank``, checked (see ``choose``); its prefixes are recorded there (they will be
        cached there)."""
        if isinstance(rank, bool) or not isinstance(rank, int) \
                or not 0 <= rank < self.num_replicas:
            raise ValueError(f"data_parallel_rank {rank!r} is out of range "
                             f"[0, {self.num_replicas})")
        if not live[rank]:
            raise RuntimeError(f"data-parallel replica {rank} (data_parallel_rank) is not "
                               "running")
        self._record(hashes, rank)
        return rank

    def _record(self, hashes: Sequence[int], replica: int) -> None:
        for h in hashes:
            self._prefix_owner[h] = replica
            self._prefix_owner.move_to_end(h)
        while len(self._prefix_owner) > self.max_entries:
            self._prefix_owner.popitem(last=False)

    def assign(self, request_id: str, replica: int, num_samples: int) -> None:
        """Count a request sent to ``replica`` (``num_samples`` samples) until it finishes."""
        self._requests[request_id] = (replica, num_samples)
        self.depth[replica] += num_samples

    def finish(self, request_id: str) -> None:
        """The request finished, was aborted or failed (unknown ids are ignored)."""
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            self.depth[entry[0]] -= entry[1]

    def replica_of(self, request_id: str) -> int | None:
        """The replica an unfinished request was sent to, or None."""
        entry = self._requests.get(request_id)
        return None if entry is None else entry[0]

    def requests_on(self, replica: int) -> list[str]:
        """The unfinished requests sent to ``replica``."""
        return [rid for rid, (r, _) in self._requests.items() if r == replica]

    def forget_replica(self, replica: int) -> None:
        """A replica died (its KV cache is gone): drop its requests and its prefixes."""
        for rid in self.requests_on(replica):
            self.finish(rid)
        for h in [h for h, r in self._prefix_owner.items() if r == replica]:
            del self._prefix_owner[h]


def cache_key(lora_request: Hashable, cache_salt: str | None,
              prompt_embeds: PromptEmbeds | None = None) -> Hashable:
    """The part of a request's prefix-cache key beside its tokens and images that the
    balancer's affinity follows: its LoRA adapter (a frozen ``LoRARequest``; id, name and
    folder, as the block hashes hold them), its ``cache_salt`` and its prompt embeddings'
    ``identifier`` (their token ids are placeholders, the same for any embeddings of a
    length: without it every such prompt was drawn to the replica of the first, where it
    cannot hit); None for the base model unsalted without embeddings (the chain then starts
    as it always did)."""
    if prompt_embeds is not None:
        return lora_request, cache_salt, prompt_embeds.identifier
    if lora_request is None and cache_salt is None:
        return None
    return lora_request, cache_salt
