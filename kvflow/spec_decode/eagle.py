"""EAGLE speculative decoding (``{"method": "eagle", "model": HEAD}``): a one-layer draft head
fed the target's final hidden states (kvflow/models/eagle.py; Li et al. 2024, arXiv
2401.15077; and DeepSeek-V3's MTP layer the same way, ``{"method": "deepseek_mtp"}``:
kvflow/models/deepseek_mtp.py), proposing inside the target's model runner like a draft model (draft_model.py:
the same lazy "mirror" pass, its own paged K/V in the target's blocks, ``num_draft_computed``).

Coordinates: the head's K/V of token index ``j >= 1`` sits at position ``j - 1`` and holds
``(x[j], f[j-1])`` (the token and the target's feature that predicted it: EAGLE shifts the
tokens one left of the features), so ``num_draft_computed = D`` means the positions ``0 ..
D - 2`` hold the head's K/V; token 0 has none. The mirror pass of a request with tokens
``x[0..n]`` (``x[n]`` sampled last step) computes indices ``D .. n`` and its last output
``h'[n-1]`` gives draft 1; draft ``i + 1`` then feeds draft ``i`` with the head's own output
in place of the target's feature (EAGLE's autoregression over features).

The target's features: after each target forward the runner hands this module the step's
final hidden states (``observe_target``), kept per request from the first position the head
has not consumed (``FeatureStash``); features of rejected drafts are overwritten by the next
step's (the stash is cut at the step's first position). Each mirror pass starts at the first
kept feature, so the head's K/V of accepted drafts (written from its own fed-back outputs) is
computed again from the target's features, as vLLM's proposer does. Positions the target never computed
(a prefix-cache hit) have no feature: the head starts after them, and attends there to the
K/V the cached blocks hold (the head's, written when a request drafting through them filled
them, or stale): only the acceptance rate can suffer, never the output, which verification
keeps exact. Constrained (structured-output) requests are drafted for as by a draft model.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvflow.attention.layer import Attention, AttentionContext
from kvflow.config import EngineConfig
from kvflow.kv_cache_interface import DRAFT_LAYER_PREFIX
from kvflow.layers.rotary import long_prompt_rope
from kvflow.models.eagle import EagleLlamaHead
from kvflow.models.loader import (
    checkpoint_tensor_names,
    iter_safetensors,
    load_hf_config,
    load_model,
)
from kvflow.models.model_resolver import resolve_model
from kvflow.quant import get_quant_config, process_weights_after_loading
from kvflow.spec_decode.draft_model import DraftModel, _naming_the_draft
from kvflow.spec_decode.draft_threads import DraftThreads
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.model_inputs import InputStager, ModelInputs, build_model_inputs

HEAD_METHODS = ("eagle", "deepseek_mtp")  # heads fed the target's features


class FeatureStash:
    """Per request, the target's final hidden states of consecutive positions the head has
    not consumed yet: ``start`` (the first position) and ``[L, H]`` rows."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[int, torch.Tensor]] = {}

    def put(self, req_id: str, start: int, features: torch.Tensor) -> None:
        """Record ``features`` [q, H] of positions ``start ..``: appended where they continue
        (or overwrite the tail of) the kept ones, else replacing them."""
        old = self.rows.get(req_id)
        if old is not None and old[0] <= start <= old[0] + len(old[1]):
            self.rows[req_id] = (old[0], torch.cat([old[1][:start - old[0]], features]))
        else:
            self.rows[req_id] = (start, features.clone())

    def drop_before(self, req_id: str, position: int) -> None:
        """Forget the rows of positions before ``position`` (consumed by the head)."""
        begin, features = self.rows[req_id]
        cut = min(max(position - begin, 0), len(features))
        self.rows[req_id] = (begin + cut, features[cut:])

    def first(self, req_id: str) -> int | None:
        """The first kept position, or None."""
        row = self.rows.get(req_id)
        return None if row is None else row[0]

    def take(self, req_id: str, start: int, count: int) -> torch.Tensor:
        """Rows of positions ``start .. start + count - 1`` ([count, H]).

        Raises:
            RuntimeError: if some of them are not kept (a bookkeeping error).
        """
        begin, features = self.rows.get(req_id, (start, torch.empty(0)))
        if start < begin or start + count > begin + len(features):
            raise RuntimeError(f"EAGLE: request {req_id!r} has target features for positions "
                               f"{begin}..{begin + len(features) - 1}, not {start}.."
                               f"{start + count - 1}")
        return features[start - begin:start - begin + count]

    def keep_only(self, req_ids: set[str]) -> None:
        """Forget requests that left the batch."""
        for rid in [r for r in self.rows if r not in req_ids]:
            del self.rows[rid]


class EagleDrafter(DraftModel):
    """The EAGLE head, its attention context and K/V, proposing as a ``DraftModel`` does.

    Args:
        config: the engine config (``speculative_config.model`` names the head).
        backend: an attention backend instance for the head's layer.
        dtype / device: the target's compute dtype and device.
        target: the target model (its embedding and LM head serve a head without its own).
        target_vocab_size: rows of the target's logits; the head must have as many.

    Raises:
        ValueError: for a head that cannot be resolved or read (after ``speculative_config
            model NAME:``), whose vocabulary or hidden size differs from the target's, or
            that leaves parameters unset.
    """

    def __init__(self, config: EngineConfig, backend: Any, dtype: torch.dtype,
                 device: torch.device, target: torch.nn.Module, target_vocab_size: int
                 ) -> None:
        spec, mc = config.speculative_config, config.model_config
        self.tp_group = None
        with _naming_the_draft(spec.model):
            source = resolve_model(spec.model, mc.download_dir)
            hf_config = load_hf_config(source, trust_remote_code=mc.trust_remote_code)
        target_hidden = target.config.hidden_size
        if hf_config.vocab_size != target_vocab_size or hf_config.hidden_size != target_hidden:
            raise ValueError(f"speculative_config model {spec.model!r}: a {spec.method} head "
                             f"of vocabulary {hf_config.vocab_size} and hidden size "
                             f"{hf_config.hidden_size} does not fit the target's "
                             f"{target_vocab_size} and {target_hidden}")
        self.attn_ctx = AttentionContext(backend)
        with _naming_the_draft(spec.model):
            if spec.method == "deepseek_mtp":
                self.model = _load_mtp(config, source, hf_config, self.attn_ctx, target, dtype,
                                       device)
            else:
                self.model = _load_head(source.path, hf_config, self.attn_ctx,
                                        _tensor_names(source.path), target, dtype, device)
        self.long_prompt_rope = long_prompt_rope(hf_config)
        self.vocab = None
        self.attn_layers = {DRAFT_LAYER_PREFIX + name: m for name, m in
                            self.model.named_modules() if isinstance(m, Attention)}
        self.device = device
        engine_threads = torch.get_num_threads()
        fixed = spec.draft_cpu_threads if device.type == "cpu" else engine_threads
        self.threads = DraftThreads([fixed] if fixed else [engine_threads, 1])
        self.max_tokens_per_pass = config.scheduler_config.max_num_batched_tokens or 2048
        self.stash = FeatureStash()
        self._fed_back: dict[int, torch.Tensor] = {}  # batch row -> the head's last output
        self._feeding_back = False

    # ---- the target's features -----------------------------------------------------------------
    def observe_target(self, batch: InputBatch, inputs: ModelInputs,
                       hidden: torch.Tensor) -> None:
        """Keep the target's final hidden states of the step just run (``hidden``: [T', H]
        with T' >= the step's tokens, in ``inputs``' token order; rows of rejected drafts are
        kept too and overwritten by the next step). Call after each target forward."""
        qs = inputs.query_start
        for i, row in enumerate(inputs.rows.tolist()):
            rid = batch.req_ids[row]
            self.stash.put(rid, int(batch.num_computed_tokens[row]), hidden[qs[i]:qs[i + 1]])
        self.stash.keep_only(set(batch.req_id_to_index))

    # ---- the passes (DraftModel's, with features) ----------------------------------------------
    def _mirror(self, batch: InputBatch, num_base: np.ndarray, drafting: np.ndarray,
                *args: Any, **kwargs: Any) -> list[float]:
        """DraftModel's mirror pass, from the first position with a target feature not yet
        fed to the head: the accepted drafts of the step before are computed again from the
        target's features, as vLLM's EAGLE proposer does (its own outputs fed them)."""
        for row in drafting.tolist():
            first = self.stash.first(batch.req_ids[row])
            batch.num_draft_computed[row] = 1 if first is None else first + 1
        steady = super()._mirror(batch, num_base, drafting, *args, **kwargs)
        for row in drafting.tolist():  # positions up to the last known token's are consumed
            self.stash.drop_before(batch.req_ids[row], int(batch.num_draft_computed[row]) - 1)
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
                 logits_rows: np.ndarray) -> torch.Tensor:
        """One head forward over token indices ``computed[r] ..`` (``query[r]`` of them) of
        each row, at positions one lower (module docstring); keeps the outputs of
        ``logits_rows``' last tokens to feed back and returns their float32 logits
        [len(logits_rows), V]."""
        ids = build_model_inputs(batch, query, block_size, stager, num_computed=computed)
        if fill_pending is not None and len(ids.pending_token_index):
            fill_pending(ids)
        at = build_model_inputs(batch, query, block_size, stager, num_computed=computed - 1,
                                long_prompt_rope=self.long_prompt_rope)
        features = self._features(batch, ids, computed, query)
        metadata = at.attn_metadata[:1]
        with self.attn_ctx.forward_context.bind(metadata):
            self.attn_ctx.backend.prepare(metadata[0], block_size)
            hidden = self.model(ids.input_ids, at.positions, features)
        last = ids.query_start[1:][np.searchsorted(ids.rows, logits_rows)] - 1
        hidden = hidden[torch.from_numpy(last).to(hidden.device)]
        self._fed_back = {row: hidden[i] for i, row in enumerate(logits_rows.tolist())}
        return self.model.compute_logits(hidden)

    def _features(self, batch: InputBatch, ids: ModelInputs, computed: np.ndarray,
                  query: np.ndarray) -> torch.Tensor:
        """[T, H]: for token index ``j``, the target's feature at ``j - 1`` (mirror passes)
        or the head's last output for the row (draft passes, one token per row)."""
        if self._feeding_back:
            return torch.stack([self._fed_back[row] for row in ids.rows.tolist()])
        return torch.cat([self.stash.take(batch.req_ids[row], int(computed[row]) - 1,
                                          int(query[row])) for row in ids.rows.tolist()])


def _tensor_names(folder: str) -> list[str]:
    """The head checkpoint's tensor names (safetensors headers, else a ``pytorch_model.bin``).

    Raises:
        ValueError: for a folder with neither.
    """
    if os.path.isfile(os.path.join(folder, "pytorch_model.bin")) and \
            not any(f.endswith(".safetensors") for f in os.listdir(folder)):
        return list(_bin_weights(folder))
    return checkpoint_tensor_names(folder)


def _bin_weights(folder: str) -> dict[str, torch.Tensor]:
    """The tensors of a ``pytorch_model.bin`` (EAGLE's own releases ship one), read with
    ``weights_only`` (no code runs)."""
    return torch.load(os.path.join(folder, "pytorch_model.bin"), map_location="cpu",
                      weights_only=True)


def _load_mtp(config: EngineConfig, source: Any, hf_config: Any, ctx: AttentionContext,
              target: torch.nn.Module, dtype: torch.dtype, device: torch.device
              ) -> torch.nn.Module:
    """The first MTP layer of a DeepSeek-V3 checkpoint (kvflow/models/deepseek_mtp.py),
    loaded as the target is (its block-FP8 weights dequantized into ``dtype``).

    Raises:
        ValueError: for a config without MTP layers, or a checkpoint lacking their tensors.
    """
    mc = config.model_config
    layer = f"model.layers.{hf_config.num_hidden_layers}."
    count = getattr(hf_config, "num_nextn_predict_layers", None)
    found = source.kind == "hf" and any(n.startswith(layer)
                                        for n in checkpoint_tensor_names(source.path))
    if not count or not found:
        raise ValueError("method 'deepseek_mtp' needs a DeepSeek-V3 HF checkpoint with MTP "
                         f"layers (num_nextn_predict_layers >= 1 and {layer}* tensors); this "
                         f"one has num_nextn_predict_layers={count} and "
                         f"{'' if found else 'no '}{layer}* tensors")
    mtp_config = copy.deepcopy(hf_config)
    mtp_config.architectures = ["DeepSeekMTPModel"]
    quant = get_quant_config(None, hf_config, source.kind, mc.quantization_group_size)
    head = load_model(source, mtp_config, ctx, dtype, device, mc.load_format, mc.seed, quant)
    head.bind_target(target)
    return head


def _load_head(folder: str, hf_config: Any, ctx: AttentionContext, names: list[str],
               target: torch.nn.Module, dtype: torch.dtype, device: torch.device
               ) -> EagleLlamaHead:
    """Build the EAGLE-1 head on ``device`` in ``dtype`` and load its checkpoint.

    Raises:
        ValueError: for a tensor that does not fit, or parameters left unset (named).
    """
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = EagleLlamaHead(hf_config, ctx, names, target)
    finally:
        torch.set_default_dtype(old)
    bin_file = os.path.isfile(os.path.join(folder, "pytorch_model.bin")) and \
        not any(f.endswith(".safetensors") for f in os.listdir(folder))
    weights = _bin_weights(folder).items() if bin_file else iter_safetensors(folder)
    loaded = head.load_weights((n, t.to(dtype) if t.is_floating_point() else t)
                               for n, t in weights)
    missing = {n for n, _ in head.named_parameters()} - loaded
    if missing:
        raise ValueError(f"the EAGLE head checkpoint lacks {sorted(missing)[:5]}")
    with torch.device(device):
        process_weights_after_loading(head)
    return head.eval()
