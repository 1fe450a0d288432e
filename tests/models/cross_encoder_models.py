"""Tiny random cross-encoders built in tests (``BertForSequenceClassification`` with a
WordPiece BERT tokenizer giving token types, ``XLMRobertaForSequenceClassification`` /
``RobertaForSequenceClassification`` with a ``<s> A </s></s> B </s>`` tokenizer), saved as HF
folders that sentence-transformers' ``CrossEncoder`` and transformers load as the oracles."""

from __future__ import annotations

from typing import Any

import torch

from tests.models.embedding_models import _randomize

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "what", "is",
         "capital", "of", "france", "paris", "city", "river", "cat", "sat", "on", "mat", "keys",
         "and", "values", "blocks", "tokens", "prefix", "caching", "reuses", "them", "engine",
         "serves", "models", "fast", "slow", "small", "large", "red", "blue", "green", "house",
         "tree"]
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "the quick brown fox jumps over a lazy dog",
             "a cat sat on the mat", "keys and values blocks of tokens",
             "the engine serves large models fast", "paris city river"]


def bert_tokenizer() -> Any:
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    return BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)})


def roberta_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<s>", "<pad>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   sep_token="</s>", cls_token="<s>", pad_token="<pad>",
                                   unk_token="<unk>", model_input_names=["input_ids",
                                                                         "attention_mask"])


def build_cross_encoder(folder: str, kind: str, num_labels: int, seed: int = 11,
                        head: str = "SequenceClassification") -> None:
    """Save a tiny random ``{kind}For{head}`` (kind: Bert, Roberta, XLMRoberta; head:
    SequenceClassification or TokenClassification; 2 layers, hidden 64) with ``num_labels``
    outputs and its tokenizer in ``folder``."""
    import transformers

    common = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 128, "num_labels": num_labels}
    if kind == "Bert":
        tokenizer = bert_tokenizer()
        config = transformers.BertConfig(vocab_size=len(tokenizer), type_vocab_size=2,
                                         max_position_embeddings=64, **common)
    else:
        tokenizer = roberta_tokenizer()
        config = getattr(transformers, f"{kind}Config")(
            vocab_size=len(tokenizer), type_vocab_size=1, max_position_embeddings=40,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, **common)
    model = getattr(transformers, f"{kind}For{head}")(config).eval()
    _randomize(model, seed, scale=0.3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def hf_scores(folder: str, pairs: list[tuple[str, str]]) -> torch.Tensor:
    """[P] (one label) or [P, num_labels]: transformers' logits of each pair, one pair at a
    time, with CrossEncoder's default activation (sigmoid for one label, none otherwise)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    rows = []
    with torch.no_grad():
        for a, b in pairs:
            logits = model(**tokenizer(a, b, return_tensors="pt")).logits[0]
            rows.append(torch.sigmoid(logits)[0] if logits.numel() == 1 else logits)
    return torch.stack(rows)


def st_scores(folder: str, pairs: list[tuple[str, str]]) -> torch.Tensor:
    """sentence-transformers' ``CrossEncoder(folder).predict(pairs)`` as a tensor."""
    from sentence_transformers import CrossEncoder

    return torch.as_tensor(CrossEncoder(folder, device="cpu").predict(
        [list(p) for p in pairs], show_progress_bar=False))
