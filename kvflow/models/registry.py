"""Architecture registry: HF ``architectures`` names and GGUF ``general.architecture`` values."""

from __future__ import annotations

from typing import Any

from torch import nn

from kvflow.models.bert import BertModel
from kvflow.models.cross_encoder import (
    BertForSequenceClassification,
    RobertaForSequenceClassification,
)
from kvflow.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from kvflow.models.deepseek_mtp import DeepSeekMTPModel
from kvflow.models.encoder_token_classifiers import (
    BertForTokenClassification,
    RobertaForTokenClassification,
)
from kvflow.models.gemma2 import Gemma2ForCausalLM
from kvflow.models.gemma3 import Gemma3ForCausalLM
from kvflow.models.glm import Glm4ForCausalLM, GlmForCausalLM
from kvflow.models.granite import GraniteForCausalLM, GraniteMoeForCausalLM
from kvflow.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from kvflow.models.llama_pooling import embedding_only, sequence_classifier, token_classifier
from kvflow.models.llava import LlavaForConditionalGeneration
from kvflow.models.llava_next import LlavaNextForConditionalGeneration
from kvflow.models.mixtral import MixtralForCausalLM
from kvflow.models.olmo2 import Olmo2ForCausalLM
from kvflow.models.phi3 import Phi3ForCausalLM
from kvflow.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from kvflow.models.qwen2_vl import Qwen2VLForConditionalGeneration
from kvflow.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from kvflow.models.roberta import RobertaModel

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    # a DeepSeek-V3 checkpoint's MTP layer as a speculative head (method deepseek_mtp)
    "DeepSeekMTPModel": DeepSeekMTPModel,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "LlavaNextForConditionalGeneration": LlavaNextForConditionalGeneration,
    # embedding (pooling) models: an encoder, and bare decoders without an LM head
    "BertModel": BertModel,
    "RobertaModel": RobertaModel,
    "XLMRobertaModel": RobertaModel,
    # masked-LM checkpoints (bert-base-uncased, roberta-base, xlm-roberta-base): the encoder
    # embeds; the MLM head is skipped when loading
    "BertForMaskedLM": BertModel,
    "RobertaForMaskedLM": RobertaModel,
    "XLMRobertaForMaskedLM": RobertaModel,
    # cross-encoders (--task score, or classify): the encoder + its classification head
    "BertForSequenceClassification": BertForSequenceClassification,
    "RobertaForSequenceClassification": RobertaForSequenceClassification,
    "XLMRobertaForSequenceClassification": RobertaForSequenceClassification,
    "LlamaModel": embedding_only(LlamaForCausalLM),
    "MistralModel": embedding_only(LlamaForCausalLM),
    "Qwen2Model": embedding_only(Qwen2ForCausalLM),
    "Qwen3Model": embedding_only(Qwen3ForCausalLM),
    # decoder sequence classifiers (--task score / classify): last-token pooling + ``score``
    "LlamaForSequenceClassification": sequence_classifier(LlamaForCausalLM),
    "MistralForSequenceClassification": sequence_classifier(LlamaForCausalLM),
    "Qwen2ForSequenceClassification": sequence_classifier(Qwen2ForCausalLM),
    "Qwen3ForSequenceClassification": sequence_classifier(Qwen3ForCausalLM),
    "MixtralForSequenceClassification": sequence_classifier(MixtralForCausalLM),
    "Qwen2MoeForSequenceClassification": sequence_classifier(Qwen2MoeForCausalLM),
    "Qwen3MoeForSequenceClassification": sequence_classifier(Qwen3MoeForCausalLM),
    # decoder token classifiers (task token_classify): every prompt token's row + ``score``
    "LlamaForTokenClassification": token_classifier(LlamaForCausalLM),
    "MistralForTokenClassification": token_classifier(LlamaForCausalLM),
    "Qwen2ForTokenClassification": token_classifier(Qwen2ForCausalLM),
    "Qwen3ForTokenClassification": token_classifier(Qwen3ForCausalLM),
    # encoder token classifiers (task token_classify): the classifier on every token's row
    "BertForTokenClassification": BertForTokenClassification,
    "RobertaForTokenClassification": RobertaForTokenClassification,
    "XLMRobertaForTokenClassification": RobertaForTokenClassification,
}

GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    # mixture-of-experts (models/gguf_moe.py); Mixtral is "llama" with llama.expert_count
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
}


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """Pick the implementation for an HF config's ``architectures`` list.

    Raises:
        ValueError: if none is supported (or the list is missing or empty), naming what was
            asked and what is supported.
    """
    for arch in architectures or []:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    if not architectures:
        raise ValueError("the model's config.json has no \"architectures\" list naming its "
                         "model class (e.g. [\"LlamaForCausalLM\"]); kvflow supports "
                         f"{sorted(MODEL_REGISTRY)}")
    raise ValueError(f"unsupported model architecture {architectures}; kvflow supports "
                     f"{sorted(MODEL_REGISTRY)}")


def model_traits(hf_config: Any) -> tuple[bool, bool]:
    """(is_pooling_only, is_encoder_only) of the config's architecture: whether it can only
    embed (no LM head) and whether it is a bidirectional encoder (no KV cache, whole prompts
    per step).

    Raises:
        ValueError: if the architecture is not supported (see :func:`get_model_class`).
    """
    model_cls = get_model_class(getattr(hf_config, "architectures", None))
    return (bool(getattr(model_cls, "is_pooling_only", False)),
            bool(getattr(model_cls, "is_encoder_only", False)))


def is_cross_encoder(hf_config: Any) -> bool:
    """Whether the config's architecture has a sequence-classification head (an encoder's or
    a decoder's ``*ForSequenceClassification``: it scores pairs, ``task="score"``, or
    classifies texts, ``task="classify"``).

    Raises:
        ValueError: if the architecture is not supported (see :func:`get_model_class`).
    """
    model_cls = get_model_class(getattr(hf_config, "architectures", None))
    return bool(getattr(model_cls, "is_cross_encoder", False))


def is_token_classifier(hf_config: Any) -> bool:
    """Whether the config's architecture has a token-classification head (an encoder's or a
    decoder's ``*ForTokenClassification``: it classifies every prompt token, ``task="token_classify"``).

    Raises:
        ValueError: if the architecture is not supported (see :func:`get_model_class`).
    """
    model_cls = get_model_class(getattr(hf_config, "architectures", None))
    return bool(getattr(model_cls, "is_token_classifier", False))


def position_offset(hf_config: Any) -> int:
    """Position-table rows the architecture keeps before its first token's (RoBERTa:
    ``pad_token_id + 1``; 0 for others): it covers ``max_position_embeddings`` minus these.

    Raises:
        ValueError: if the architecture is not supported (see :func:`get_model_class`).
    """
    model_cls = get_model_class(getattr(hf_config, "architectures", None))
    offset = getattr(model_cls, "position_offset", None)
    return int(offset(hf_config)) if offset is not None else 0


def uses_mla(hf_config: Any) -> bool:
    """Whether the config's architecture runs multi-head latent attention (DeepSeek-V2/V3):
    such a model needs an MLA attention backend and caches one latent vector per token.

    Raises:
        ValueError: if the architecture is not supported (see :func:`get_model_class`).
    """
    model_cls = get_model_class(getattr(hf_config, "architectures", None))
    return bool(getattr(model_cls, "uses_mla", False))


def attention_soft_cap(hf_config: Any) -> float | None:
    """The cap of the architecture's soft-capped attention logits (Gemma 2's
    ``attn_logit_softcapping``), or None: such a model needs an attention backend that
    computes it (the torch one).

    Raises:
        ValueError: if the architecture is not supported (see :func:`get_model_class`).
    """
    model_cls = get_model_class(getattr(hf_config, "architectures", None))
    soft_cap = getattr(model_cls, "attention_soft_cap", None)
    return soft_cap(hf_config) if soft_cap is not None else None


def is_multimodal(hf_config: Any) -> bool:
    """Whether the config's architecture takes images (a vision encoder in front of the
    decoder; its prompts carry image placeholders and M-RoPE positions where it uses them).

    Raises:
        ValueError: if the architecture is not supported (see :func:`get_model_class`).
    """
    model_cls = get_model_class(getattr(hf_config, "architectures", None))
    return bool(getattr(model_cls, "supports_multimodal", False))
