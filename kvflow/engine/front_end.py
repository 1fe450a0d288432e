"""AsyncLLM's own share of the model, in the API process: what it loads while the
engine-core processes start (config.json and ``--quantization`` checked, sampling defaults,
EOS ids, the tokenizer, a vision-language model's multimodal processor) and the
InputProcessor built from it once the cores report ready (their ``EngineReady``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvflow.config import EngineConfig
from kvflow.engine.messages import EngineReady
from kvflow.engine.replica_set import ReplicaSet
from kvflow.inputs.processor import InputProcessor
from kvflow.logits_process import load_logits_processors
from kvflow.models.generation_config import load_eos_token_ids, load_sampling_defaults
from kvflow.models.loader import load_hf_config, load_tokenizer, resolve_eos_token_id
from kvflow.models.model_resolver import resolve_model
from kvflow.models.tokenizer_source import tokenizer_source
from kvflow.multimodal import mm_processor_of_source
from kvflow.quant import get_quant_config
from kvflow.spec_decode.draft_tokenizer import check_draft_tokenizer

__all__ = ["FrontEnd", "load_front_end", "make_input_processor"]


@dataclass(frozen=True)
class FrontEnd:
    """What the API process loaded of the model (``load_front_end``).

    Attributes:
        tokenizer: the transformers tokenizer, None under ``skip_tokenizer_init``.
        sampling_defaults: SamplingParams fields from generation_config.json (see
            ``load_sampling_defaults``).
        eos_token_ids: every EOS id the model declares (``load_eos_token_ids``).
        mm_processor: a vision-language model's MultiModalProcessor, else None.
    """

    tokenizer: Any
    sampling_defaults: dict[str, Any]
    eos_token_ids: list[int]
    mm_processor: Any


def load_front_end(config: EngineConfig, replicas: ReplicaSet,
                   on_tokenizer: Callable[[Any], None] | None = None) -> FrontEnd:
    """Start ``replicas`` gated, check the model's config.json and quantization here, release
    them, then load the tokenizer and multimodal processor while they load the model.
    ``on_tokenizer`` is called with the tokenizer (None under ``skip_tokenizer_init``) last.

    Raises:
        ValueError: for a bad model, config, quantization, generation config, tokenizer or
            draft tokenizer; whatever ``on_tokenizer`` raises.
    """
    mc = config.model_config
    source = resolve_model(mc.model, mc.download_dir, mc.revision, mc.hf_token)  # a Hub download happens here
    # the core processes start now (their resolve_model then finds the snapshot
    # cached) and import the engine while config.json is checked here, before
    # anything reads it: the tokenizer below (transformers may read it to pick the
    # tokenizer class) would call a broken one a tokenizer failure, and the cores
    # load nothing of a model whose config failed (they wait for release())
    replicas.start(gated=True)
    hf_config = load_hf_config(source, hf_overrides=mc.hf_overrides,
                               trust_remote_code=mc.trust_remote_code)
    # --quantization against the checkpoint's metadata, before any weight is read
    get_quant_config(mc.quantization, hf_config, source.kind, mc.quantization_group_size)
    sampling_defaults = load_sampling_defaults(source, mc.generation_config,
                                               mc.override_generation_config)
    eos_token_ids = load_eos_token_ids(source, vocab_size=hf_config.vocab_size)
    replicas.release()
    # while the core processes load the model:
    tokenizer = None if mc.skip_tokenizer_init else \
        load_tokenizer(source, tokenizer_source(mc), mc.download_dir, mc.tokenizer_options,
                       mc.hf_token)
    check_draft_tokenizer(config, source, tokenizer)
    mm_processor = mm_processor_of_source(source, tokenizer, config.multimodal_config,
                                          mc.hf_overrides, mc.trust_remote_code)
    if on_tokenizer is not None:
        on_tokenizer(tokenizer)
    return FrontEnd(tokenizer, sampling_defaults, eos_token_ids, mm_processor)


def make_input_processor(config: EngineConfig, front: FrontEnd,
                         ready: EngineReady) -> InputProcessor:
    """The InputProcessor of the model the cores loaded (``ready``: context length,
    vocabulary, pooler, hidden size), with the engine's custom logits processors (none for a
    pooling model).

    Raises:
        ValueError: for a custom logits processor that cannot be loaded.
    """
    mc = config.model_config
    return InputProcessor(front.tokenizer, ready.max_model_len, ready.vocab_size,
                          resolve_eos_token_id(front.tokenizer, ready), front.mm_processor,
                          eos_token_ids=front.eos_token_ids,
                          pooler=ready.pooler, hidden_size=ready.hidden_size,
                          max_model_len_note=ready.max_model_len_note,
                          enable_prompt_embeds=mc.enable_prompt_embeds,
                          logits_processors=() if ready.pooler else
                          load_logits_processors(mc.custom_logits_processors()))
