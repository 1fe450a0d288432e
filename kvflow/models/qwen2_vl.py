"""Qwen2-VL: a vision encoder in front of a Qwen2 decoder with M-RoPE.

The decoder is kvflow's Qwen2 (``models/llama.py``) with the multimodal rotary embedding
(``layers/mrotary.py``): positions are ``[3, num_tokens]``. The model runner asks the model
three things besides the usual forward:

* ``embed_multimodal(pixel_values, grids)``: run the vision encoder (``qwen2_vl_vision.py``)
  once over one or several images and return each image's embeddings, one row per
  placeholder token;
* ``embed_input_ids(input_ids)``: token embeddings, into which the runner writes those rows
  at the placeholder positions before calling ``forward(..., inputs_embeds=...)``;
* ``get_mrope_input_positions(prompt_token_ids, features)``: the prompt's (temporal, height,
  width) position ids and the offset that continues them for generated tokens, computed
  once when a request is admitted (they depend on the image grids).

Checkpoints name the parts ``visual.*``, ``model.*`` and ``lm_head.*`` (as transformers'
``save_pretrained`` writes them); transformers 5's in-memory names
``model.visual.*`` / ``model.language_model.*`` are accepted too, in checkpoints and in LoRA
adapters (``checkpoint_name``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from kvflow.attention.layer import AttentionContext
from kvflow.distributed.comm import IntermediateTensors
from kvflow.distributed.parallel_state import ParallelState
from kvflow.inputs.multimodal import MultiModalFeature
from kvflow.layers.mrotary import MRotaryEmbedding
from kvflow.layers.rope_parameters import get_rope_parameters, rope_max_positions
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.models.llama import Qwen2ForCausalLM, get_head_dim
from kvflow.models.qwen2_vl_vision import Qwen2VisionTransformer

_RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def mrope_input_positions(token_ids: list[int], features: list[MultiModalFeature],
                          spatial_merge_size: int, tokens_per_second: float | None = None
                          ) -> tuple[np.ndarray, int]:
    """M-RoPE position ids of a prompt (Qwen2-VL / Qwen2.5-VL's ``get_rope_index``).

    Text tokens count up on all three axes. An image or video of ``t x h x w`` merged patches
    starting at running position ``p`` gives its tokens ids ``(p + ti * s, p + hi, p + wi)``
    where ``s`` is 1, except for a video of a model with ``tokens_per_second`` (Qwen2.5-VL):
    ``int(ti * tokens_per_second * second_per_grid_t)`` (the technical report's absolute
    time encoding, arXiv:2502.13923 sec. 2.1.1). The text after it continues from the
    largest id given plus one (the original Qwen code's and vLLM's rule; transformers 5
    continues from ``p + max(h, w)``, the same unless a video's time ids pass its height and
    width ids).

    Args:
        token_ids: the prompt (placeholders expanded).
        features: its images and videos, each covering ``[offset, offset + length)``.
        spatial_merge_size: patches merged per side into one token.
        tokens_per_second: the vision config's ``tokens_per_second`` (None: Qwen2-VL).

    Returns:
        (positions int64 [3, len(token_ids)], delta): a generated token at index ``i``
        (>= the prompt length) has position ``i + delta`` on every axis.
    """
    positions = np.empty((3, len(token_ids)), np.int64)
    cursor = pos = 0
    for f in sorted(features, key=lambda f: f.offset):
        positions[:, cursor:f.offset] = pos + np.arange(f.offset - cursor)
        pos += f.offset - cursor
        t, h, w = f.grid_thw
        h, w = h // spatial_merge_size, w // spatial_merge_size
        ti = np.arange(t)
        if tokens_per_second is not None and f.second_per_grid_t is not None:
            ti = (ti * (f.second_per_grid_t * tokens_per_second)).astype(np.int64)
        tt, hh, ww = np.meshgrid(ti, np.arange(h), np.arange(w), indexing="ij")
        positions[:, f.offset:f.end] = pos + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
        pos += max(h, w, int(ti[-1]) + 1)
        cursor = f.end
    positions[:, cursor:] = pos + np.arange(len(token_ids) - cursor)
    delta = int(positions.max(initial=-1)) + 1 - len(token_ids)
    return positions, delta


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    """Qwen2-VL: ``forward(input_ids [T], positions [3, T], inputs_embeds=[T, hidden])``.

    Args:
        config: a ``Qwen2VLConfig`` whose text fields kvflow's loader hoisted to the top
            level (``vision_config`` stays nested), plus ``image_token_id``.
        ctx / parallel: as for every kvflow model.
    """

    supports_multimodal = True
    uses_mrope = True
    vision_tower_cls = Qwen2VisionTransformer
    scales_video_time = False  # Qwen2.5-VL: video time ids in tokens_per_second steps

    def __init__(self, config: Any, ctx: AttentionContext,
                 parallel: ParallelState | None = None) -> None:
        super().__init__(config, ctx, parallel)
        self.visual = self.vision_tower_cls(config.vision_config)
        self.spatial_merge_size = config.vision_config.spatial_merge_size
        # Qwen2.5-VL's video time ids step by tokens_per_second * second_per_grid_t
        self.tokens_per_second = None
        if self.scales_video_time:  # transformers' Qwen2_5_VLVisionConfig default: 4
            self.tokens_per_second = _vision_field(config.vision_config,
                                                   "tokens_per_second") or 4

    @classmethod
    def rotary_embedding_for(cls, config: Any) -> RotaryEmbedding:
        """M-RoPE with the config's ``mrope_section``.

        Raises:
            ValueError: if the config has no ``mrope_section``.
        """
        theta, scaling = get_rope_parameters(config)
        params = getattr(config, "rope_parameters", None) or \
            getattr(config, "rope_scaling", None) or {}
        section = params.get("mrope_section")
        if section is None:
            raise ValueError("a Qwen2-VL config needs rope_parameters.mrope_section")
        return MRotaryEmbedding(get_head_dim(config), rope_max_positions(config), theta,
                                list(section), scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None
                ) -> torch.Tensor | IntermediateTensors:
        """input_ids int64 [T], positions int64 [3, T] (or [T] for text only),
        inputs_embeds [T, hidden] (image rows merged; None: embed ``input_ids``) -> final
        hidden [T, hidden] (or the next pipeline stage's tensors)."""
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    # ---- multimodal --------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] of input_ids int64 [T]."""
        return self.model.embed_tokens(input_ids)

    def embed_multimodal(self, pixel_values: list[torch.Tensor],
                         grid_thw: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Run the vision encoder once over several images.

        Args:
            pixel_values: per image float32 [num_patches, patch_dim] (any device).
            grid_thw: per image (temporal, height, width) patches.

        Returns:
            Per image [t * h * w / merge^2, hidden] in the model's dtype: the rows for its
            placeholder tokens, in order.
        """
        device = self.visual.patch_embed.proj.weight.device
        merged = self.visual(torch.cat(pixel_values).to(device), grid_thw)
        sizes = [t * h * w // self.spatial_merge_size ** 2 for t, h, w in grid_thw]
        return list(merged.split(sizes))

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A checkpoint's (or a PEFT adapter's) module or tensor name in kvflow's naming:
        transformers 5's ``model.language_model.*`` / ``model.visual.*`` become ``model.*`` /
        ``visual.*``; other names are kept."""
        return _rename(name)

    def get_mrope_input_positions(self, token_ids: list[int],
                                  features: list[MultiModalFeature]) -> tuple[np.ndarray, int]:
        """See :func:`mrope_input_positions`."""
        return mrope_input_positions(token_ids, features, self.spatial_merge_size,
                                     self.tokens_per_second)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the decoder, the LM head and the vision encoder (see the module docstring for
        the names); returns the parameters loaded.

        Raises:
            ValueError: for a checkpoint tensor that matches no parameter.
        """
        return super().load_weights((_rename(name), t) for name, t in weights)


def _vision_field(vision_config: Any, name: str) -> Any:
    """A vision config's field (a config object, or a dict before it is built); None if
    absent."""
    if isinstance(vision_config, dict):
        return vision_config.get(name)
    return getattr(vision_config, name, None)


def _rename(name: str) -> str:
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name
