"""Tiny random embedding models built in tests and saved as sentence-transformers folders
(modules.json, 1_Pooling/config.json, Normalize), with sentence-transformers as the oracle."""

from __future__ import annotations

import copy
from typing import Any

import torch


def _randomize(model: torch.nn.Module, seed: int, scale: float = 0.1) -> None:
    """Seeded weights in place, parameters visited in name order: norm weights
    1 + N(0, 0.2), biases N(0, 0.2), every other parameter N(0, ``scale``)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen)
            is_norm = "norm" in name.lower()
            param.copy_(1.0 + 0.2 * noise if is_norm and name.endswith("weight")
                        else 0.2 * noise if name.endswith("bias") else scale * noise)


def save_sentence_transformer(model: Any, tokenizer: Any, folder: str, pooling: str,
                              normalize: bool = True) -> Any:
    """Save ``model`` + ``tokenizer`` as a sentence-transformers folder; returns the
    SentenceTransformer loaded back from it."""
    from sentence_transformers import SentenceTransformer, models

    raw = folder + "_hf"
    model.save_pretrained(raw)
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.pad_token = tokenizer.eos_token  # sentence-transformers pads even one sentence
    tokenizer.save_pretrained(raw)
    word = models.Transformer(raw)
    modules = [word, models.Pooling(word.get_word_embedding_dimension(), pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(folder)
    return SentenceTransformer(folder, device="cpu")


def st_embed(st: Any, sentences: list[str]) -> list[torch.Tensor]:
    return [torch.from_numpy(st.encode([s], convert_to_numpy=True)[0]) for s in sentences]


def build_bert(tokenizer: Any, folder: str, pooling: str) -> Any:
    """A tiny random BERT encoder saved as a sentence-transformers folder; returns the
    SentenceTransformer."""
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=128, type_vocab_size=2)
    model = BertModel(config).eval()
    _randomize(model, 3)
    return save_sentence_transformer(model, tokenizer, folder, pooling)


def build_decoder(tokenizer: Any, folder: str, pooling: str) -> Any:
    """A tiny random bare Llama decoder (``LlamaModel``, Matryoshka-capable) saved as a
    sentence-transformers folder; returns the SentenceTransformer."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rms_norm_eps=1e-6, is_matryoshka=True)
    model = LlamaModel(config).eval()
    _randomize(model, 4)
    return save_sentence_transformer(model, tokenizer, folder, pooling)


def build_roberta(tokenizer: Any, folder: str, pooling: str, xlm: bool = False) -> Any:
    """A tiny random RoBERTa (``xlm``: XLM-RoBERTa) encoder with 40 position rows (38 tokens
    after padding_idx + 1 = 2) saved as a sentence-transformers folder; returns the
    SentenceTransformer."""
    import transformers

    kind = "XLMRoberta" if xlm else "Roberta"
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=40, type_vocab_size=1, pad_token_id=1)
    model = getattr(transformers, f"{kind}Model")(config, add_pooling_layer=False).eval()
    _randomize(model, 5)
    return save_sentence_transformer(model, tokenizer, folder, pooling)
