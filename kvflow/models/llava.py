"""LLaVA (``LlavaForConditionalGeneration``): a CLIP (or SigLIP) vision tower, a two-layer
projector and a Llama / Mistral decoder.

LLaVA-1.5 (Liu et al. 2023, arXiv:2310.03744): the image, resized and center-cropped to the
tower's ``image_size`` by the CLIP image processor, runs through the vision tower
(``clip_vision.py``); the hidden states after ``vision_feature_layer`` (default -2: the
second-to-last layer's output; for a list of layers, theirs concatenated along the hidden
size), without the class token for
``vision_feature_select_strategy`` "default" (all tokens for "full"), go through the
projector ``linear_2(act(linear_1(x)))`` to the decoder's width and replace the image's
placeholder tokens (``image_token_index``), one row per token: 576 for a 336-pixel image of
14-pixel patches. The decoder is kvflow's Llama with ordinary 1-D positions.

The model runner calls ``embed_multimodal`` / ``embed_input_ids`` as for Qwen2-VL
(``kvflow/worker/mm_runner.py``). Checkpoint names: kvflow's are ``model.*`` (decoder),
``lm_head.*``, ``vision_tower.*`` (``embeddings.*``, ``encoder.layers.N.*``, ...) and
``multi_modal_projector.*``. Also read (``checkpoint_name``, for LoRA adapters too):
transformers 5's in-memory names ``model.language_model.*`` / ``model.vision_tower.*`` /
``model.multi_modal_projector.*``, and the names checkpoints are saved with (by
transformers 4 and 5: llava-hf/llava-1.5-7b-hf) ``language_model.model.*`` /
``language_model.lm_head.*`` / ``vision_tower[.vision_model].*`` /
``multi_modal_projector.*``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from kvflow.attention.layer import AttentionContext
from kvflow.distributed.parallel_state import ParallelState
from kvflow.models.clip_vision import VISION_MODEL_TYPES, VisionTower, _field
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.qwen2_vl_vision import vision_activation

_RENAMES = (("model.language_model.", "model."),
            ("model.vision_tower.vision_model.", "vision_tower."),
            ("model.vision_tower.", "vision_tower."),
            ("vision_tower.vision_model.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
            ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))
SELECT_STRATEGIES = ("default", "full")


def check_llava_config(config: Any, anyres: bool = False) -> None:
    """Refuse the LLaVA config fields kvflow does not compute; ``anyres``: the config is
    LLaVA-NeXT's, whose ``image_grid_pinpoints`` are read (``llava_next_packing.py``).

    Raises:
        ValueError: naming the field: ``vision_feature_layer`` neither an integer nor a
            non-empty list of integers, a ``vision_feature_select_strategy`` other than "default"
            / "full", ``image_grid_pinpoints`` (any-resolution tiling) in a LLaVA-1.5
            config, or a vision tower other than CLIP / SigLIP.
    """
    layer = getattr(config, "vision_feature_layer", -2)
    layers = layer if isinstance(layer, (list, tuple)) else [layer]
    if not layers or any(isinstance(v, bool) or not isinstance(v, int) for v in layers):
        raise ValueError(f"vision_feature_layer={layer!r}: an integer (the vision layer "
                         "read) or a non-empty list of integers (the layers read, "
                         "concatenated)")
    strategy = getattr(config, "vision_feature_select_strategy", "default")
    if strategy not in SELECT_STRATEGIES:
        raise ValueError(f"vision_feature_select_strategy={strategy!r}: choose one of "
                         f"{list(SELECT_STRATEGIES)}")
    if not anyres and getattr(config, "image_grid_pinpoints", None):
        raise ValueError("image_grid_pinpoints (LLaVA-NeXT any-resolution tiling) in a "
                         "LlavaForConditionalGeneration config: LLaVA-1.5 runs one fixed-size "
                         "image per placeholder; LLaVA-NeXT checkpoints name "
                         "LlavaNextForConditionalGeneration")
    model_type = _field(config.vision_config, "model_type")
    if model_type not in VISION_MODEL_TYPES:
        raise ValueError(f"vision_config.model_type={model_type!r}: kvflow's LLaVA runs "
                         f"{sorted(VISION_MODEL_TYPES)} vision towers")


def llava_image_tokens(config: Any, grid_thw: tuple[int, int, int]) -> int:
    """Placeholder tokens of one image of ``grid_thw`` patches (t = 1): one per patch, plus
    CLIP's class token for strategy "full", minus the first token for "default" (as
    transformers' ``LlavaProcessor`` counts them)."""
    t, h, w = grid_thw
    class_token = VISION_MODEL_TYPES.get(_field(config.vision_config, "model_type"), True)
    drop = getattr(config, "vision_feature_select_strategy", "default") == "default"
    return t * h * w + int(class_token) - int(drop)


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = vision_activation(act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """LLaVA: ``forward(input_ids [T], positions [T], inputs_embeds=[T, hidden])``.

    Args:
        config: a ``LlavaConfig`` whose text fields kvflow's loader hoisted to the top level
            (``vision_config`` stays nested), with ``image_token_index``,
            ``vision_feature_layer``, ``vision_feature_select_strategy``,
            ``projector_hidden_act`` and ``multimodal_projector_bias``.
        ctx / parallel: as for every kvflow model.

    Raises:
        ValueError: for config fields kvflow does not compute (:func:`check_llava_config`).
    """

    supports_multimodal = True
    uses_mrope = False
    # checkpoint names (kvflow's) this class loads itself; the rest is the decoder's
    own_prefixes: tuple[str, ...] = ("vision_tower.", "multi_modal_projector.")
    anyres = False  # LLaVA-NeXT's image_grid_pinpoints tiling (its subclass)

    def __init__(self, config: Any, ctx: AttentionContext,
                 parallel: ParallelState | None = None) -> None:
        check_llava_config(config, anyres=self.anyres)
        super().__init__(config, ctx, parallel)
        vision = config.vision_config
        self.vision_tower = VisionTower(vision, getattr(config, "vision_feature_layer", -2))
        self.multi_modal_projector = LlavaMultiModalProjector(  # a block per feature layer
            vision.hidden_size * self.vision_tower.num_features, config.hidden_size,
            getattr(config, "projector_hidden_act", "gelu"),
            bool(getattr(config, "multimodal_projector_bias", True)))
        self.drop_first = getattr(config, "vision_feature_select_strategy",
                                  "default") == "default"

    @staticmethod
    def image_token_count(config: Any, grid_thw: tuple[int, int, int],
                          image_size: tuple[int, int] | None = None) -> int:
        """Placeholder tokens of one image (see :func:`llava_image_tokens`; ``image_size``,
        the original pixels, does not change it)."""
        return llava_image_tokens(config, grid_thw)

    def embed_multimodal(self, pixel_values: list[torch.Tensor],
                         grid_thw: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Run the vision tower and the projector once over several images.

        Args:
            pixel_values: per image float32 [h * w, channels * patch^2] patch rows (any
                device); every image has the tower's ``image_size``.
            grid_thw: per image (1, h, w) patches.

        Returns:
            Per image [tokens, hidden] in the model's dtype (tokens: :func:`llava_image_tokens`).
        """
        weight = self.multi_modal_projector.linear_1.weight
        patches = torch.stack([p.to(weight.device) for p in pixel_values])
        features = self.vision_tower(patches.to(weight.dtype))
        if self.drop_first:
            features = features[:, 1:]
        return list(self.multi_modal_projector(features).unbind(0))

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A checkpoint's (or a PEFT adapter's) module or tensor name in kvflow's naming (see
        the module docstring); other names are kept."""
        for old, new in _RENAMES:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the decoder, the LM head, the vision tower and the projector, in any of the
        namings of the module docstring; tensors of vision layers past the feature layer and
        of the tower's final norm / pooling head are skipped. Returns the parameters loaded.

        Raises:
            ValueError: for a checkpoint tensor that matches no parameter or whose shape does
                not fit it.
        """
        own = {n: p for n, p in self.named_parameters() if n.startswith(self.own_prefixes)}
        loaded: set[str] = set()

        def decoder_weights():
            """Copies the tower's and projector's tensors, yields the decoder's.

            Raises:
                ValueError: for a tower or projector tensor without its parameter, or of
                    another shape.
            """
            for name, tensor in weights:
                name = self.checkpoint_name(name)
                if not name.startswith(self.own_prefixes):
                    yield name, tensor
                    continue
                if name.startswith("vision_tower.") and \
                        not self.vision_tower.needs(name[len("vision_tower."):]):
                    continue
                # read here: the decoder's loader would fuse the tower's q/k/v_proj
                if name not in own:
                    raise ValueError(f"checkpoint tensor {name!r} matches no parameter of "
                                     f"{type(self).__name__}")
                if own[name].shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {name!r}: shape "
                                     f"{tuple(tensor.shape)} does not fit the parameter's "
                                     f"{tuple(own[name].shape)}")
                with torch.no_grad():
                    own[name].copy_(tensor)
                loaded.add(name)

        return super().load_weights(decoder_weights()) | loaded
