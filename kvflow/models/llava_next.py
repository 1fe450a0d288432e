"""LLaVA-NeXT (``LlavaNextForConditionalGeneration``, llava-hf/llava-v1.6-*): LLaVA's vision
tower, projector and Llama / Mistral decoder (``llava.py``), each image cut into
any-resolution tiles whose features are packed with the ``image_newline`` vector
(``llava_next_packing.py``).

The API side ships each image as its tiles' patch rows (the base tile first, each tile cut
like LLaVA's one image), ``grid_thw = (tiles, h, w)`` patches and the image's original
``image_size`` (height, width), which picks the tile grid and the unpadding. Checkpoint
names: LLaVA's, plus ``image_newline`` (transformers 5's in-memory name:
``model.image_newline``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvflow.attention.layer import AttentionContext
from kvflow.distributed.parallel_state import ParallelState
from kvflow.models.llava import LlavaForConditionalGeneration
from kvflow.models.llava_next_packing import (
    check_llava_next_config,
    llava_next_image_tokens,
    pack_image_features,
)


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT: ``forward(input_ids [T], positions [T], inputs_embeds=[T, hidden])``.

    Args:
        config: a ``LlavaNextConfig`` (hoisted as for :class:`LlavaForConditionalGeneration`)
            with ``image_grid_pinpoints``.
        ctx / parallel: as for every kvflow model.

    Raises:
        ValueError: for config fields kvflow does not compute (LLaVA's, and
            :func:`~kvflow.models.llava_next_packing.check_llava_next_config`).
    """

    own_prefixes = LlavaForConditionalGeneration.own_prefixes + ("image_newline",)
    anyres = True

    def __init__(self, config: Any, ctx: AttentionContext,
                 parallel: ParallelState | None = None) -> None:
        check_llava_next_config(config)
        super().__init__(config, ctx, parallel)
        self.image_newline = nn.Parameter(torch.zeros(config.hidden_size))

    @staticmethod
    def image_token_count(config: Any, grid_thw: tuple[int, int, int],
                          image_size: tuple[int, int] | None = None) -> int:
        """Placeholder tokens of one image of ``image_size`` (height, width) pixels (see
        :func:`~kvflow.models.llava_next_packing.llava_next_image_tokens`).

        Raises:
            ValueError: without ``image_size``.
        """
        if image_size is None:
            raise ValueError("LLaVA-NeXT needs each image's original size to count its "
                             "placeholder tokens")
        return llava_next_image_tokens(config, image_size)

    def embed_multimodal(self, pixel_values: list[torch.Tensor],
                         grid_thw: list[tuple[int, int, int]],
                         image_sizes: list[tuple[int, int]] | None = None
                         ) -> list[torch.Tensor]:
        """Run the vision tower and the projector once over every tile of several images,
        then pack each image's tiles.

        Args:
            pixel_values: per image float32 [tiles * h * w, channels * patch^2] patch rows,
                tile by tile, the base tile first (any device).
            grid_thw: per image (tiles, h, w) patches.
            image_sizes: per image its original (height, width) pixels.

        Returns:
            Per image [tokens, hidden] in the model's dtype (tokens:
            :func:`~kvflow.models.llava_next_packing.llava_next_image_tokens`).

        Raises:
            ValueError: without ``image_sizes``, or for a tile count the grid does not give.
        """
        if image_sizes is None or len(image_sizes) != len(pixel_values):
            raise ValueError("LLaVA-NeXT needs each image's original size (image_sizes)")
        weight = self.multi_modal_projector.linear_1.weight
        tiles = [p.to(weight.device).reshape(t, h * w, -1)
                 for p, (t, h, w) in zip(pixel_values, grid_thw, strict=True)]
        features = self.vision_tower(torch.cat(tiles).to(weight.dtype))
        if self.drop_first:
            features = features[:, 1:]
        features = self.multi_modal_projector(features)
        per_image = features.split([t.shape[0] for t in tiles])
        return [pack_image_features(self.config, f, size, self.image_newline)
                for f, size in zip(per_image, image_sizes, strict=True)]

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """LLaVA's names (:meth:`LlavaForConditionalGeneration.checkpoint_name`), and
        transformers 5's ``model.image_newline`` as ``image_newline``."""
        if name == "model.image_newline":
            return "image_newline"
        return LlavaForConditionalGeneration.checkpoint_name(name)
