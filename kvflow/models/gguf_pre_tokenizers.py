"""llama.cpp pre-tokenizers (GGUF ``tokenizer.ggml.pre``) that transformers' GGUF conversion does
not know, as ``tokenizers`` pre-tokenizers.

llama.cpp (``llm_tokenizer_bpe`` in llama-vocab.cpp) splits text with a list of regexes applied
one after another: each regex cuts every piece from the previous one into its matches and the
text between them (both kept), which is ``tokenizers``' ``Split(regex, "isolated")``; the
pieces are then mapped to byte-level characters (``ByteLevel(use_regex=False)``), as in the
models' own HF ``tokenizer.json``. transformers falls back to GPT-2's regex for these values,
which cuts text where the vocabulary's merges were not learned (DeepSeek Coder: ``" 12"`` is one
GPT-2 piece, but ``" "``, ``"1"``, ``"2"`` in llama.cpp and the model's tokenizer.json).
"""

from __future__ import annotations

from typing import Any

# DeepSeek LLM's "letters": the cased-letter ranges (Lu, Ll, Lt) its tokenizer.json lists.
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126"
    "\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
    "\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f"
    "\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
# CJK ideographs, U+0800..U+4E00 and Hangul: one piece per run (both DeepSeek pre-tokenizers).
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
# Qwen2's regex: letters after one non-letter, single digits, punctuation runs, newlines
_QWEN2 = (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
          "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

# tokenizer.ggml.pre -> the regexes llama.cpp applies in turn (llama-vocab.cpp, by value).
SPLIT_REGEXES: dict[str, tuple[str, ...]] = {
    "default": ("[\\p{P}\\$\\+<=>\\^~\\|]+", _GPT2, "\\p{N}+", "[0-9][0-9][0-9]"),
    "falcon": ("[\\p{P}\\$\\+<=>\\^~\\|`]+", _GPT2, "[0-9][0-9][0-9]"),
    "stablelm2": (_QWEN2,), "hunyuan": (_QWEN2,), "grok-2": (_QWEN2,),
    "glm4": (_QWEN2.replace("|\\p{N}|", "|\\p{N}{1,3}|"),),
    "chatglm-bpe": (_QWEN2.replace("|\\p{N}|", "|\\p{N}{1,3}|"),),
    "seed-coder": (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}"
                   "| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), ((
        "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
        "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"),)),
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), (_BLOOM,)),
    "viking": (_BLOOM, "\\p{N}"),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense"), (
        "\\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?"
         "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"))),
    "deepseek-llm": (
        "[\r\n]",
        "\\s?[" + _DEEPSEEK_LLM_LETTERS + "]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        "\\s+$",
        _DEEPSEEK_CJK,
        "\\p{N}+",
    ),
    "deepseek-coder": (
        "[\r\n]",
        "\\s?\\p{L}+",
        "\\s?\\p{P}+",
        _DEEPSEEK_CJK,
        "\\p{N}",
    ),
}

# Pre-tokenizers that split every digit off, then apply GPT-2's regex (llama-vocab.cpp:
# "\\p{N}", then the GPT-2 pattern); the HF tokenizer.json of SmolLM / StarCoder spells it
# Digits(individual_digits=True) + ByteLevel.
DIGIT_SPLIT_PRES = frozenset({"starcoder", "refact", "command-r", "smollm", "codeshell",
                              "exaone", "minerva", "minerva-7b"})

# Values llama.cpp splits with GPT-2's regex (transformers' default for a byte-level vocabulary)
GPT2_PRES = frozenset({"gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v1-en",
                       "jina-v2-es", "jina-v2-de", "jina-v2-code", "roberta-bpe", "a.x-4.0",
                       "mellum", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"})
# Values transformers' GGUF conversion splits as llama.cpp does (its GGUF_PRE_TOKENIZER_SPLITS)
TRANSFORMERS_PRES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                               "pixtral", "midm-2.0", "lfm2", "dbrx", "smaug-bpe", "tekken",
                               "qwen2", "deepseek-r1-qwen", "kormo", "megrez", "gpt-4o",
                               "llama4", "minimax-m2"})


def check_pre_tokenizer(pre: Any) -> str | None:
    """None when kvflow splits text as llama.cpp does for ``tokenizer.ggml.pre = pre`` (a
    byte-level vocabulary; an absent value is llama.cpp's ``"default"``), else why not: a
    value llama.cpp handles with custom code (``kimi-k2``, ``afmoe``, ``superbpe``,
    ``chameleon``), one unknown to kvflow, or a value that is not a string."""
    if pre is not None and not isinstance(pre, str):
        return f"is {pre!r:.80}, not a string"
    if pre is None or pre in SPLIT_REGEXES or pre in DIGIT_SPLIT_PRES or pre in GPT2_PRES \
            or pre in TRANSFORMERS_PRES or pre in _transformers_pres():
        return None
    return (f"is {pre!r}, a pre-tokenizer kvflow does not reproduce (it would split text "
            "where the vocabulary's merges were not learned)")


def _transformers_pres() -> frozenset[str]:
    """The installed transformers' own GGUF pre-tokenizer table (empty where it has none)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_PRE_TOKENIZER_SPLITS,
        )
    except ImportError:
        return frozenset()
    return frozenset(GGUF_PRE_TOKENIZER_SPLITS)


def llama_cpp_pre_tokenizer(pre: Any) -> Any | None:
    """The ``tokenizers`` pre-tokenizer llama.cpp's ``tokenizer.ggml.pre`` value ``pre`` means,
    for a byte-level (``tokenizer.ggml.model = gpt2``) vocabulary; None for a value whose
    transformers conversion is already right (or unknown to kvflow). An absent key
    (``pre is None``) is ``"default"``, as llama.cpp's loader decides
    (``LLAMA_VOCAB_PRE_TYPE_DEFAULT``, with a "missing pre-tokenizer type" warning); transformers
    would split it with GPT-2's regex alone.

    Returns:
        a ``tokenizers.pre_tokenizers.Sequence``: the ``Split(..., "isolated")`` of each of
        :data:`SPLIT_REGEXES` then ``ByteLevel(use_regex=False)``, or, for
        :data:`DIGIT_SPLIT_PRES`, ``Digits(individual_digits=True)`` then GPT-2's
        ``ByteLevel(use_regex=True)``.
    """
    from tokenizers import Regex, pre_tokenizers

    if pre in DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre is None:
        pre = "default"
    regexes = SPLIT_REGEXES.get(pre) if isinstance(pre, str) else None
    if regexes is None:
        return None
    return pre_tokenizers.Sequence(
        [*(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
