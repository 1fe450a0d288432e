"""DeepSeek-V3's multi-token-prediction (MTP) module as a speculative draft head
(``{"method": "deepseek_mtp"}``; DeepSeek-V3 report, arXiv 2412.19437, section 2.2; vLLM's
``DeepSeekMTPModel``).

The target's checkpoint holds ``num_nextn_predict_layers`` MTP layers after its decoder
layers, ``model.layers.{N}.*`` with ``N = num_hidden_layers`` (kvflow runs the first). For a
position ``p`` the module takes the NEXT token ``x[p+1]`` and the target's final hidden state
``f[p]`` (EAGLE's shift, kvflow/spec_decode/eagle.py):

    h'[p] = block(eh_proj(concat(enorm(embed(x[p+1])), hnorm(f[p]))))

(the embedding zeroed at position 0, as vLLM does), ``block`` one DeepSeek decoder layer
(MLA, dense or MoE MLP as the checkpoint holds it), and the logits are
``shared_head.head(shared_head.norm(h'))``. ``h'`` (the residual stream's output) is fed back
as the next draft's feature. The embedding and output head are the target's (the report:
"shared" with the main model; the layer's ``embed_tokens`` / ``shared_head.head`` copies are
not loaded).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from kvflow.attention.layer import AttentionContext
from kvflow.distributed.parallel_state import ParallelState
from kvflow.layers.norm import RMSNorm
from kvflow.models.deepseek import DeepseekDecoderLayer, DeepseekV3ForCausalLM
from kvflow.models.mixtral import SparseMoeForCausalLM

MTP_SHARED = ("embed_tokens.", "shared_head.head.")  # the target's, not loaded


class MTPLayer(DeepseekDecoderLayer):
    """One MTP layer: a DeepSeek decoder layer plus ``enorm``, ``hnorm``, ``eh_proj`` and
    ``shared_head.norm`` (names as in the checkpoint)."""

    def __init__(self, config: Any, layer_idx: int, ctx: AttentionContext, rotary_emb: Any,
                 routing: Any, parallel: ParallelState) -> None:
        super().__init__(config, layer_idx, ctx, rotary_emb, routing, parallel)
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, config.rms_norm_eps)


class DeepSeekMTPModel(DeepseekV3ForCausalLM):
    """The first MTP layer of a DeepSeek-V3 checkpoint: ``forward(input_ids [T], positions
    [T], features [T, H]) -> [T, H]`` and ``compute_logits([N, H]) -> float32 [N, V]`` (the
    EAGLE head's interface); ``bind_target`` gives it the target's embedding and LM head.

    Raises:
        ValueError: from the constructor when the config has no MTP layer
            (``num_nextn_predict_layers`` 0 or missing).
    """

    def __init__(self, config: Any, ctx: AttentionContext,
                 parallel: ParallelState | None = None) -> None:
        nn.Module.__init__(self)
        if not getattr(config, "num_nextn_predict_layers", 0):
            raise ValueError("speculative_config method='deepseek_mtp' needs a checkpoint with "
                             "MTP layers (config.json num_nextn_predict_layers >= 1)")
        self.config = config
        parallel = parallel or ParallelState.single()
        self.mtp_index = config.num_hidden_layers
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(self.mtp_index): MTPLayer(
            config, self.mtp_index, ctx, self.make_rotary(config), self.routing_for(config),
            parallel)})
        self._target: list[nn.Module] = []

    def bind_target(self, target: nn.Module) -> None:
        """Use ``target``'s ``embed_input_ids`` and ``compute_logits`` (not a submodule)."""
        self._target = [target]

    @property
    def layer(self) -> MTPLayer:
        return self.model.layers[str(self.mtp_index)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                features: torch.Tensor) -> torch.Tensor:
        """int64 [T] tokens ``x[p+1]``, int64 [T] positions ``p``, [T, H] features ``f[p]``
        -> [T, H] ``h'[p]`` (module docstring)."""
        layer = self.layer
        embeds = self._target[0].embed_input_ids(input_ids).to(features.dtype)
        embeds = torch.where((positions == 0).unsqueeze(-1), 0.0, embeds)
        hidden = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(features)], dim=-1))
        hidden, residual = layer(positions, hidden, None)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor, head: Any = None) -> torch.Tensor:
        """[N, H] -> float32 [N, V]: the target's LM head after ``shared_head.norm``."""
        return self._target[0].compute_logits(self.layer.shared_head.norm(hidden))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the first MTP layer's tensors (``model.layers.{N}.*``; the others and the
        shared embedding / head copies skipped). Returns the loaded parameters' names.

        Raises:
            ValueError: for an MTP tensor that matches no parameter.
        """
        prefix = f"model.layers.{self.mtp_index}."

        def mtp_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(prefix) and not name[len(prefix):].startswith(MTP_SHARED):
                    yield name, tensor

        return SparseMoeForCausalLM.load_weights(self, mtp_weights())
