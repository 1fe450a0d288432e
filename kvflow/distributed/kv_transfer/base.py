"""The KV connector interface (vLLM's KV connector v1, cut to what kvflow's lock-step engine
needs): a scheduler half, asked at admission how many prompt tokens it can supply and told
which blocks to fill, and a worker half that moves those blocks between the KV cache and the
connector's storage around the step's forward pass. What crosses from one half to the other
each step is ``KVConnectorMetadata`` (``kvflow/kv_connector_meta.py``).

The step, as the engine runs it::

    Scheduler.schedule   admission: num_external = get_num_new_matched_tokens(request, hits)
                         blocks allocated for hits + external + the step's tokens
                         update_state_after_alloc(request, block_ids, hits, num_external)
                         (the external tokens count as computed, as prefix-cache hits do)
                         end of the step: out.kv_connector_metadata = build_connector_meta(...)
    ModelRunner          start_load_kv(meta)  -> forward pass -> wait_for_save(meta)
                         (without the saves that read a block that failed to load)
    Scheduler.update_from_output  load_failed / saves_dropped (recompute)
    Scheduler._free      request_finished(request)
    reload_weights       weights_changed(model_key, layout, running)

Loads are synchronous (done before the forward pass starts), so the layer-wise hooks of vLLM's
interface (``wait_for_layer_load``, ``save_kv_layer``) have nothing to do and are not part of
this one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from kvflow.distributed.kv_transfer.storage_layouts import StorageLayout
from kvflow.kv_connector_meta import KVConnectorMetadata
from kvflow.request import Request

# layer name -> (its K/V tensor [2, num_blocks, block_size, kv_heads, head_dim], its scales
# [2, num_blocks, block_size, kv_heads] for a quantized cache, else None); read at each use
# (the tensors are reallocated when a sleeping engine wakes up)
KVTensors = Callable[[], dict[str, tuple[torch.Tensor, torch.Tensor | None]]]


class KVConnectorScheduler(ABC):
    """The scheduler half: decides what to load and save. Called only on the engine core's
    scheduling thread; it may keep per-request state until ``request_finished``."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """How many prompt tokens after the first ``num_computed_tokens`` (the local
        prefix-cache hit, whole blocks) storage can supply: whole blocks, never the request's
        last token (its logits must be computed). 0 when none, or for a request this
        connector skips. Asked at each admission attempt (nothing is reserved)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int],
                                 num_computed_tokens: int, num_external_tokens: int) -> None:
        """The request was admitted with ``num_external_tokens`` (> 0, what
        ``get_num_new_matched_tokens`` answered) after its ``num_computed_tokens`` local hits:
        ``block_ids`` is its group-0 block table, whose blocks for those tokens are to be
        loaded before this step's forward pass."""

    @abstractmethod
    def build_connector_meta(self, scheduled: Sequence[Request],
                             block_ids_of: Callable[[str], Sequence[int]]
                             ) -> KVConnectorMetadata:
        """The step's loads (every admission since the last call) and saves, given the step's
        scheduled requests (their ``num_computed_tokens`` already advanced past the step) and
        a request id -> its group-0 block table."""

    @abstractmethod
    def load_failed(self, request: Request, key: str) -> int:
        """The worker could not load ``request``'s block ``key`` (nor any after it): never
        offer that key again. Returns the block's index in the request's prompt blocks (the
        request is recomputed from there)."""

    @abstractmethod
    def saves_dropped(self, request: Request) -> None:
        """The worker did not save ``request``'s blocks of the last step (it read a block
        that could not be loaded) and it is recomputed: save them as the recompute writes
        them."""

    @abstractmethod
    def weights_changed(self, model_key: str, layout: StorageLayout,
                        running: set[str]) -> None:
        """``reload_weights`` built the model again (its files may have changed): blocks
        are keyed by ``model_key`` (and the layout recorded as ``layout``) from now on, and
        the ``running`` requests (K/V computed by the old weights, or to be computed over
        them) store nothing more. Called between steps."""

    @abstractmethod
    def request_finished(self, request: Request) -> None:
        """The request left the engine (finished or aborted; its blocks are freed now, after
        any save of an earlier step ran): drop its state."""


class KVConnectorWorker(ABC):
    """The worker half: moves blocks between the KV cache and storage on the runner."""

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata) -> list[int]:
        """Fill ``meta.loads``' blocks from storage (before the forward pass; synchronous).

        Returns:
            per transfer of ``meta.loads``, the index of its first block that could not be
            loaded, or -1 (``kv_load_failure_policy="recompute"``).

        Raises:
            ValueError: with ``kv_load_failure_policy="fail"``, if a block is missing from
                storage or does not fit this KV cache."""

    @abstractmethod
    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        """Write ``meta.saves``' blocks to storage (after the forward pass wrote them). The
        runner leaves out the saves that read a block the step failed to load
        (``KVConnectorMetadata.without_saves_reading``)."""

