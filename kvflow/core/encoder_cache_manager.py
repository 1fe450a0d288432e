"""The scheduler's side of the vision encoder: which images to encode each step, within a
per-step budget, and a mirror of the runners' encoder cache.

The rule (vLLM v1's, in its simplest form): a step that computes tokens ``[start, start + n)``
of a request needs the embeddings of every image whose placeholder range overlaps them. An
image already in the encoder cache (or scheduled by an earlier request of the same step) is
reused: an encoder-cache hit. Otherwise the image is encoded this step if its tokens fit what
is left of ``max_num_encoder_input_tokens`` (the first image of a step always fits, so an
image larger than the budget still runs, alone); if not, the request's chunk is cut just
before that image and the image waits for the next step. A big image therefore costs its own
steps instead of stalling the decodes batched with it, and the running decodes are scheduled
first anyway (they never need the encoder).

The runners keep each encoded image's rows, by identifier, until told to drop them; this
class decides that, so both sides always agree on what is cached. An image is pinned while a
request still has its placeholder tokens ahead (it may be needed in a later chunk); once none
does, it stays cached for reuse, least recently released first out, within
``encoder_cache_size`` tokens. Drops are sent with the *next* step (the current step may still
read the rows), and cancelled if the image is encoded again meanwhile.

Counters (cumulative, to /metrics): images looked up, found cached, and encoded.
"""

from __future__ import annotations

from collections import OrderedDict

from kvflow.inputs.multimodal import MultiModalFeature
from kvflow.request import Request
from kvflow.sched_output import SchedulerOutput


class EncoderCacheManager:
    """Encoder budget per step and the mirror of the runners' encoder cache.

    Args:
        max_num_encoder_input_tokens: encoder output tokens one step may compute.
        cache_size: tokens of unpinned embeddings kept for reuse.
    """

    def __init__(self, max_num_encoder_input_tokens: int, cache_size: int) -> None:
        self.budget_per_step = max_num_encoder_input_tokens
        self.cache_size = cache_size
        self.cached: dict[str, int] = {}  # identifier -> tokens, in the runners' caches
        self.pins: dict[str, set[str]] = {}  # identifier -> requests still needing it
        self.unpinned: OrderedDict[str, int] = OrderedDict()  # reusable, oldest first
        self._unpinned_tokens = 0
        self._to_free: list[str] = []  # evicted; sent with the next step
        self._budget = max_num_encoder_input_tokens
        self._encoded_this_step = 0
        self.num_queries = self.num_hits = self.num_encoded = 0

    # ---- one step ----------------------------------------------------------------------------
    def begin_step(self, out: SchedulerOutput) -> None:
        """Reset the step's budget and hand the runners the drops decided since the last
        step."""
        self._budget, self._encoded_this_step = self.budget_per_step, 0
        out.free_encoder_mm_hashes.extend(self._to_free)
        self._to_free = []

    def plan(self, request: Request, start: int, num_new: int) -> tuple[int, list[int]]:
        """Tokens of ``[start, start + num_new)`` the step can compute given the encoder,
        and the indices of the request's images to encode for them. Nothing is reserved
        until :meth:`commit`.

        Returns:
            (num_new, indices): ``num_new`` is cut just before the first image that must be
            encoded but does not fit the step's remaining budget (0: nothing this step).
        """
        to_encode, planned = [], set()
        budget, first = self._budget, self._encoded_this_step == 0
        for i, f in enumerate(request.mm_features or ()):
            if f.offset >= start + num_new:
                break
            if f.end <= start or f.identifier in self.cached or f.identifier in planned:
                continue
            if f.length > budget and not (first and not to_encode):
                return max(0, f.offset - start), to_encode
            to_encode.append(i)
            planned.add(f.identifier)
            budget -= f.length
        return num_new, to_encode

    def commit(self, request: Request, start: int, num_new: int, to_encode: list[int],
               out: SchedulerOutput) -> None:
        """Record a planned chunk that was scheduled: reserve its encodes, pin the images
        it touches, and unpin those it finishes."""
        features = request.mm_features
        to_encode = self._still_cached(request, start, start + num_new, to_encode)
        for i in to_encode:
            f = features[i]
            self._budget -= f.length
            self._encoded_this_step += f.length
            self.cached[f.identifier] = f.length
            self.num_encoded += 1
            if f.identifier in self._to_free:
                self._to_free.remove(f.identifier)
        if to_encode:
            out.scheduled_encoder_inputs[request.request_id] = to_encode
        end = start + num_new
        ahead = {f.identifier for f in features if f.end > end}  # needed by a later chunk
        for i, f in enumerate(features):
            if f.offset >= end or f.end <= start:
                continue
            self._pin(f, request.request_id, counted=i in to_encode)
            if f.identifier not in ahead:  # its last placeholder is computed this step
                self._unpin(f.identifier, request.request_id)

    def _still_cached(self, request: Request, start: int, end: int, to_encode: list[int]
                      ) -> list[int]:
        """``to_encode`` after re-checking the chunk's other images: one the plan found
        cached may have been evicted since (making room for the chunk preempted the request
        that pinned it). Its drop is still pending - the runners hold it this step - so the
        drop is cancelled; were it gone, it is encoded again (appended to the list)."""
        planned = {request.mm_features[i].identifier for i in to_encode}
        for i, f in enumerate(request.mm_features):
            if f.offset >= end or f.end <= start or f.identifier in self.cached or \
                    f.identifier in planned:
                continue
            if f.identifier in self._to_free:
                self._to_free.remove(f.identifier)
                self.cached[f.identifier] = f.length
            else:
                to_encode = [*to_encode, i]
                planned.add(f.identifier)
        return to_encode

    def release(self, request: Request) -> None:
        """The request finished or was preempted: it needs none of its images now."""
        for f in request.mm_features or ():
            self._unpin(f.identifier, request.request_id)

    def forget(self, identifiers: set[str]) -> None:
        """Images whose encode was scheduled in steps that failed (the model raised): the
        runners may never have stored them. Taken out of the mirror, and dropped by any
        runner that did store them, so a later request encodes them again (a hit would read
        rows that do not exist). Call once the failed steps' requests released them."""
        for identifier in identifiers:
            size = self.cached.pop(identifier, None)
            if size is None:
                continue
            self.pins.pop(identifier, None)
            if self.unpinned.pop(identifier, None) is not None:
                self._unpinned_tokens -= size
            self._to_free.append(identifier)

    # ---- pins and eviction -------------------------------------------------------------------
    def _pin(self, f: MultiModalFeature, request_id: str, counted: bool) -> None:
        pins = self.pins.setdefault(f.identifier, set())
        if request_id in pins:
            return
        self.num_queries += 1
        self.num_hits += not counted
        pins.add(request_id)
        size = self.unpinned.pop(f.identifier, None)
        if size is not None:
            self._unpinned_tokens -= size

    def _unpin(self, identifier: str, request_id: str) -> None:
        pins = self.pins.get(identifier)
        if pins is None or request_id not in pins:
            return
        pins.discard(request_id)
        if pins:
            return
        del self.pins[identifier]
        size = self.cached.get(identifier)
        if size is None:  # forgotten after a failed step: nothing to keep
            return
        self.unpinned[identifier] = size
        self._unpinned_tokens += size
        while self._unpinned_tokens > self.cache_size:
            old, old_size = self.unpinned.popitem(last=False)
            self._unpinned_tokens -= old_size
            del self.cached[old]
            self._to_free.append(old)

    @property
    def num_cached_tokens(self) -> int:
        """Embedding rows the runners hold now (pinned and reusable)."""
        return sum(self.cached.values())
