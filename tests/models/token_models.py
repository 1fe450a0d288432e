"""Tiny random models for vLLM's per-token pooling tasks, built in tests: transformers'
``{Llama,Qwen2,...}ForTokenClassification`` (2 layers, hidden 64, a head with bias) and a bare
``LlamaModel`` (a decoder embedder), with ``classifier_models.bpe_tokenizer``; and the
oracle: transformers' per-token logits / ``last_hidden_state`` of one unpadded prompt."""

from __future__ import annotations

from typing import Any

import torch

from tests.models.classifier_models import PAD_ID, bpe_tokenizer, family_config
from tests.models.embedding_models import _randomize


def _config(kind: str, vocab: int, **extra: Any) -> Any:
    import transformers

    return getattr(transformers, f"{kind}Config")(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, pad_token_id=PAD_ID, tie_word_embeddings=False,
        **family_config(kind), **extra)


def build_token_classifier(folder: str, kind: str, num_labels: int, seed: int = 17) -> None:
    """Save a tiny random ``{kind}ForTokenClassification`` (head with bias) and its
    tokenizer in ``folder``."""
    import transformers

    tokenizer = bpe_tokenizer()
    model = getattr(transformers, f"{kind}ForTokenClassification")(
        _config(kind, len(tokenizer), num_labels=num_labels)).eval()
    _randomize(model, seed, scale=0.3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def build_bare_decoder(folder: str, seed: int = 19) -> None:
    """Save a tiny random bare ``LlamaModel`` (a decoder embedder: last-token pooling,
    normalized, prefix caching on) and its tokenizer in ``folder``."""
    import transformers

    tokenizer = bpe_tokenizer()
    model = transformers.LlamaModel(_config("Llama", len(tokenizer))).eval()
    _randomize(model, seed, scale=0.3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def hf_token_outputs(folder: str, text: str, kind: str) -> torch.Tensor:
    """[T, D] float32: transformers' per-token logits (``kind`` "token_classify") or
    ``last_hidden_state`` ("token_embed") of one unpadded prompt."""
    from transformers import AutoModel, AutoModelForTokenClassification, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(text, return_tensors="pt")["input_ids"]
    cls = AutoModelForTokenClassification if kind == "token_classify" else AutoModel
    model = cls.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=ids)
    return (out.logits if kind == "token_classify" else out.last_hidden_state)[0].float()
