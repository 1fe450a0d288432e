"""Tiny random decoder sequence classifiers built in tests (transformers'
``LlamaForSequenceClassification``, ``Qwen2ForSequenceClassification``,
``Qwen3ForSequenceClassification``; 2 layers, hidden 64) with a byte-level BPE tokenizer
that adds no special tokens (as Qwen's), saved as HF folders; and the oracle: transformers'
``AutoModelForSequenceClassification`` logits on a right-padded batch (it pools each row's
last non-pad token) with softmax or sigmoid."""

from __future__ import annotations

from typing import Any

import torch

from tests.models.cross_encoder_models import WORDS
from tests.models.embedding_models import _randomize

PAD_ID = 0
TEXTS = ["the quick brown fox jumps over a lazy dog", "what is the capital of france",
         "paris", "a cat sat on the mat and the dog sat on the tree",
         "keys and values blocks of tokens", "the engine serves large models fast"]


def bpe_tokenizer() -> Any:
    """A byte-level BPE tokenizer trained on ``WORDS`` (``<pad>`` = 0), adding no special
    tokens: transformers loads a folder's tokenizer by the model's type (Qwen2Tokenizer,
    LlamaTokenizer rebuild it from the vocabulary and merges), which keeps a byte-level BPE's
    tokens (a word-level one comes back as one token for every word)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([" ".join(WORDS)] * 4 + TEXTS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


def family_config(kind: str) -> dict[str, Any]:
    """The config fields a tiny ``kind`` decoder needs beyond the shared ones: Qwen3's
    head_dim; the sparse MoE decoders' 4 experts, 2 per token (Qwen2-MoE adds a shared
    expert)."""
    return {"Qwen3": {"head_dim": 16},
            "Mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
            "Qwen2Moe": {"num_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64},
            "Qwen3Moe": {"num_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                         "moe_intermediate_size": 32}}.get(kind, {})


def build_decoder_classifier(folder: str, kind: str, num_labels: int, seed: int = 13,
                             id2label: dict[int, str] | None = None) -> None:
    """Save a tiny random ``{kind}ForSequenceClassification`` (kind: Llama, Qwen2, Qwen3,
    or the sparse MoE Mixtral, Qwen2Moe, Qwen3Moe)
    with ``num_labels`` classes (names ``id2label``, transformers' LABEL_i by default) and
    its tokenizer in ``folder``."""
    import transformers

    tokenizer = bpe_tokenizer()
    extra = family_config(kind)
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, num_labels=num_labels, pad_token_id=PAD_ID,
        tie_word_embeddings=False, **extra,
        **({"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}}
           if id2label else {}))
    model = getattr(transformers, f"{kind}ForSequenceClassification")(config).eval()
    _randomize(model, seed, scale=0.3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def hf_logits(folder: str, texts: list[str]) -> torch.Tensor:
    """[N, num_labels] float32: transformers' logits of ``texts`` as one right-padded batch
    (the model pools each row's last non-pad token)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "right"
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(**tokenizer(texts, return_tensors="pt", padding=True)).logits.float()


# LLM-as-reranker checkpoints: a causal LM whose answer tokens' logits give the relevance
# (Qwen3-Reranker answers "no" / "yes"); these are tokens of ``bpe_tokenizer``'s vocabulary
NO_TOKEN, YES_TOKEN = "Ġdog", "Ġthe"


def build_causal_reranker(folder: str, kind: str = "Qwen3", tied: bool = False,
                          seed: int = 29) -> None:
    """Save a tiny random ``{kind}ForCausalLM`` (kind as :func:`build_decoder_classifier`'s;
    the LM head tied to the embedding when ``tied``) and ``bpe_tokenizer`` in ``folder``: a reranker served
    through ``--hf-overrides`` (``classifier_from_token``)."""
    import transformers

    tokenizer = bpe_tokenizer()
    extra = family_config(kind)
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, pad_token_id=PAD_ID, tie_word_embeddings=tied, **extra)
    model = getattr(transformers, f"{kind}ForCausalLM")(config).eval()
    _randomize(model, seed, scale=0.3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def hf_last_token_logits(folder: str, token_ids: list[list[int]]) -> torch.Tensor:
    """[N, vocab] float32: transformers' causal-LM logits at each prompt's last token (one
    prompt at a time, no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                            for ids in token_ids])


def hf_reranker_scores(folder: str, token_ids: list[list[int]]) -> torch.Tensor:
    """[N] the reranker's relevance by its own definition: softmax over the "no" / "yes"
    logits at the last token, P(yes) = sigmoid(logit_yes - logit_no)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    no, yes = tokenizer.convert_tokens_to_ids([NO_TOKEN, YES_TOKEN])
    logits = hf_last_token_logits(folder, token_ids)
    return torch.softmax(logits[:, [no, yes]], dim=-1)[:, 1]
