"""A transformers tokenizer from a GGUF file's tokenizer metadata, cached on disk."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from kvflow.models.gguf_pre_tokenizers import check_pre_tokenizer, llama_cpp_pre_tokenizer
from kvflow.models.gguf_reader import GGUFMetadata, read_gguf_metadata

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Build a transformers (fast) tokenizer from the GGUF's tokenizer metadata.

    Uses ``AutoTokenizer.from_pretrained(dirname, gguf_file=basename)`` (a
    ``PreTrainedTokenizerFast``-style tokenizer; GGUF ``tokenizer.ggml.add_bos_token`` is
    honoured by transformers, and its absence means llama.cpp's default, see
    :func:`_llama_cpp_add_bos`). The returned tokenizer has ``chat_template`` set from the GGUF
    key ``tokenizer.chat_template`` when transformers did not set it (a dict with the named
    ones where the file has ``tokenizer.chat_template.<name>``: :func:`gguf_chat_templates`),
    and its bos/eos/pad
    tokens are made to match ``tokenizer.ggml.{bos,eos,padding}_token_id`` when present. The
    result is saved under the kvflow cache directory and reloaded from there next time (see
    ``_tokenizer_cache_dir``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a valid GGUF file, or its tokenizer metadata is missing
            or malformed (see :func:`check_tokenizer_metadata`), or transformers cannot build
            a tokenizer from it: naming the file (and the key where one is at fault).
    """
    meta = read_gguf_metadata(path)  # validates the file first (fast)
    check_tokenizer_metadata(meta)
    _warn_missing_pre(meta)
    cached = _tokenizer_cache_dir(meta.path)
    tokenizer = _load_cached_tokenizer(cached)
    if tokenizer is not None:
        return tokenizer
    tokenizer = _convert_gguf_tokenizer(meta)
    _apply_gguf_metadata(tokenizer, meta)
    if cached is not None:
        _save_tokenizer_cache(tokenizer, cached)
    return tokenizer


def _load_cached_tokenizer(cached: str | None) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved in cache folder ``cached``; None for no folder, an empty one or an
    unreadable entry (rebuilt then)."""
    from transformers import AutoTokenizer

    if cached is not None and os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except (OSError, ValueError):
            pass  # unreadable cache entry: rebuilt by the caller
    return None


def _convert_gguf_tokenizer(meta: GGUFMetadata) -> PreTrainedTokenizerBase:
    """transformers' conversion of the file's tokenizer metadata
    (``AutoTokenizer.from_pretrained(dirname, gguf_file=basename)``).

    Raises:
        ValueError: naming the file, for any error of the conversion.
    """
    from transformers import AutoTokenizer

    directory, filename = os.path.split(os.path.abspath(meta.path))
    try:
        return AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    except Exception as e:  # transformers' GGUF conversion raises many types
        raise ValueError(f"{meta.path!r}: cannot build a tokenizer from the GGUF tokenizer "
                         f"metadata ({type(e).__name__}: {e}); {_USE_TOKENIZER}") from e


def _apply_gguf_metadata(tokenizer: PreTrainedTokenizerBase, meta: GGUFMetadata) -> None:
    """What transformers' conversion leaves out, set on ``tokenizer`` in place: SentencePiece
    spacing, llama.cpp's pre-tokenizer, the chat template(s), the bos/eos/pad tokens of
    ``tokenizer.ggml.{bos,eos,padding}_token_id`` and llama.cpp's BOS default."""
    _spm_spacing(tokenizer, meta)
    _llama_cpp_pre(tokenizer, meta)
    template = gguf_chat_templates(meta)  # transformers reads the default one only
    if isinstance(template, dict) or (template and not tokenizer.chat_template):
        tokenizer.chat_template = template
    for attr, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and getattr(tokenizer, f"{attr}_id") != token_id:
            token = tokenizer.convert_ids_to_tokens(int(token_id))
            if token is not None:
                setattr(tokenizer, attr, token)
    _llama_cpp_add_bos(tokenizer, meta)


def gguf_chat_templates(meta: GGUFMetadata) -> str | dict[str, str] | None:
    """The file's chat template(s): ``tokenizer.chat_template`` alone as a string; with named
    ones (``tokenizer.chat_template.<name>``, listed in ``tokenizer.chat_templates``, as
    gguf-py writes a tokenizer_config.json's list of templates, e.g. Hermes' ``tool_use``)
    a dict ``{"default": ..., name: ...}`` as transformers loads such a list, so a request
    with tools renders with ``tool_use`` there; None without any."""
    names = meta.get("tokenizer.chat_templates")
    named = {}
    for name in names if isinstance(names, list) else []:
        text = meta.get(f"tokenizer.chat_template.{name}") if isinstance(name, str) else None
        if isinstance(text, str) and text and name != "default":
            named[name] = text
    default = meta.get("tokenizer.chat_template")
    default = default if isinstance(default, str) and default else None
    if not named:
        return default
    return {**({"default": default} if default is not None else {}), **named}


def _spm_spacing(tokenizer: Any, meta: GGUFMetadata) -> None:
    """Give a sentencepiece (``tokenizer.ggml.model`` ``llama``) vocabulary of a non-Gemma file
    sentencepiece's own spacing, as llama.cpp and the HF ``tokenizer.json`` of Llama 2 /
    Mistral / TinyLlama have it: a space prepended to the text only when
    ``tokenizer.ggml.add_space_prefix`` (default true) says so, then every space a ``\u2581``,
    and decoding strips that one prepended space only. transformers builds a ``Metaspace``
    that always prepends and swallows a leading space (``" hello"`` became ``\u2581hello``, its
    decode ``"hello"``; ``add_space_prefix = false`` was ignored). Gemma files (their own
    builder) are left alone."""
    if meta.get("tokenizer.ggml.model") != "llama" or \
            str(meta.get("general.architecture", "")).startswith("gemma"):
        return
    from tokenizers import decoders, normalizers

    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    backend = tokenizer.backend_tokenizer
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    backend.pre_tokenizer = None
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), *strip])


def _llama_cpp_pre(tokenizer: Any, meta: GGUFMetadata) -> None:
    """For a byte-level vocabulary whose ``tokenizer.ggml.pre`` transformers does not convert
    (DeepSeek LLM / Coder, the digit-splitting StarCoder family, an absent key = llama.cpp's
    ``"default"``): llama.cpp's pre-tokenizer,
    from :func:`~kvflow.models.gguf_pre_tokenizers.llama_cpp_pre_tokenizer`."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        return
    pre_tokenizer = llama_cpp_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    if pre_tokenizer is not None:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizer


# tokenizer.ggml.pre values for which llama.cpp (llama-vocab.cpp) prepends the BOS token when
# the file has no tokenizer.ggml.add_bos_token (Llama 3, Falcon 3, Mistral's Tekken, ...)
_BOS_BY_DEFAULT_PRES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                  "pixtral", "midm-2.0", "lfm2", "tekken", "chameleon"})


def _llama_cpp_add_bos(tokenizer: Any, meta: GGUFMetadata) -> None:
    """Prepend BOS, as llama.cpp does, for a byte-level vocabulary whose
    ``tokenizer.ggml.pre`` llama.cpp gives a BOS by default (:data:`_BOS_BY_DEFAULT_PRES`) when
    the file has no ``tokenizer.ggml.add_bos_token`` (Llama 3 GGUFs converted before
    gguf-py read the BOS from ``tokenizer.json``'s post-processor): transformers' conversion
    then added none, though the model's own ``tokenizer.json`` and llama.cpp do. The key, where
    present, is honoured by transformers as it is."""
    if meta.get("tokenizer.ggml.model") != "gpt2" or \
            meta.get("tokenizer.ggml.add_bos_token") is not None or \
            meta.get("tokenizer.ggml.pre") not in _BOS_BY_DEFAULT_PRES or \
            tokenizer.bos_token is None or tokenizer.add_bos_token:
        return
    tokenizer.add_bos_token = True  # transformers rebuilds the post-processor with BOS


def _warn_missing_pre(meta: GGUFMetadata) -> None:
    """Log (once per load) that a byte-level vocabulary has no ``tokenizer.ggml.pre`` and is
    split with llama.cpp's ``"default"`` regexes, as llama.cpp warns for such a file."""
    if meta.get("tokenizer.ggml.model") == "gpt2" and meta.get("tokenizer.ggml.pre") is None:
        logger.warning("%s: GGUF has no 'tokenizer.ggml.pre'; splitting text with llama.cpp's "
                       "'default' pre-tokenizer as llama.cpp does (tokenization may differ "
                       "from the original model's; pass --tokenizer to use its own)", meta.path)


_USE_TOKENIZER = "pass a Hugging Face tokenizer folder with --tokenizer (LLM(tokenizer=...))"
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id",
                  "seperator_token_id", "separator_token_id")


def check_tokenizer_metadata(meta: GGUFMetadata) -> None:
    """Check the ``tokenizer.ggml.*`` keys transformers builds the tokenizer from: ``model``
    present, ``tokens`` a non-empty list of strings, ``token_type`` / ``scores`` as long as it,
    a byte-level vocabulary's ``pre`` one kvflow splits as llama.cpp does,
    every ``merges`` entry two parts joined by one space, and the special token ids in range.

    Raises:
        ValueError: naming the file and the key at fault (transformers raised a bare
            KeyError / IndexError / TypeError from inside its conversion).
    """
    def bad(key: str, problem: str) -> ValueError:
        return ValueError(f"{meta.path!r}: GGUF metadata key 'tokenizer.ggml.{key}' {problem}; "
                          f"{_USE_TOKENIZER}")

    if meta.get("tokenizer.ggml.model") is None:
        raise bad("model", "is missing (the file carries no tokenizer)")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise bad("tokens", "is missing or not a non-empty list of strings")
    for key in ("token_type", "scores"):
        values = meta.get(f"tokenizer.ggml.{key}")
        if values is not None and (not isinstance(values, list) or len(values) != len(tokens)):
            raise bad(key, f"does not hold one value per token ({len(tokens)} tokens)")
    if meta.get("tokenizer.ggml.model") == "gpt2":
        problem = check_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        if problem is not None:
            raise bad("pre", problem)
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None and not isinstance(merges, list):
        raise bad("merges", f"is {merges!r:.80}, not a list of merges")
    if merges is not None:
        broken = next((m for m in merges if not isinstance(m, str) or m.count(" ") != 1), None)
        if broken is not None:
            raise bad("merges", f"has an entry that is not two tokens joined by one space "
                      f"({broken!r})")
    for key in _TOKEN_ID_KEYS:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and (isinstance(token_id, bool) or not isinstance(token_id, int)
                                     or not 0 <= token_id < len(tokens)):
            raise bad(key, f"is {token_id!r}, not a token id below the {len(tokens)} tokens")


# Token texts llama.cpp (llama-vocab.cpp) treats as end-of-generation wherever a vocabulary
# has them: chat models end turns with these rather than with tokenizer.ggml.eos_token_id.
EOG_TOKEN_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                             "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
                             "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>"})


def gguf_eos_token_ids(path: str) -> list[int]:
    """Every token id that ends generation for the GGUF at ``path``, as llama.cpp decides:
    ``tokenizer.ggml.eos_token_id``, ``eot_token_id`` and ``eom_token_id``, then every token
    whose text is in :data:`EOG_TOKEN_TEXTS` (e.g. Gemma 3's ``<end_of_turn>`` beside its
    ``<eos>``: [1, 106], Qwen2.5's ``<|im_end|>`` and ``<|endoftext|>``, as their
    generation_config.json lists them). In that order, without repeats; ``[]`` when the file
    has no tokenizer.

    Raises:
        FileNotFoundError, ValueError: see :func:`read_gguf_metadata`.
    """
    meta = read_gguf_metadata(path)
    tokens = meta.get("tokenizer.ggml.tokens")
    tokens = tokens if isinstance(tokens, list) else []  # a mistyped vocabulary: none
    ids = [meta.get(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id",
                                                         "eom_token_id")]
    ids += [i for i, text in enumerate(tokens) if text in EOG_TOKEN_TEXTS]
    return list(dict.fromkeys(int(i) for i in ids
                              if isinstance(i, int) and 0 <= i < len(tokens)))


# Bump when load_gguf_tokenizer changes what it saves, so earlier cache entries are not reused.
_CACHE_FORMAT = 9


def _tokenizer_cache_dir(path: str) -> str | None:
    """Cache folder for the tokenizer built from ``path``, keyed by the file's absolute path,
    size and mtime, the transformers version that converts it and :data:`_CACHE_FORMAT`
    (None when the file cannot be stat'ed): an upgraded transformers (whose GGUF conversion
    may tokenize differently) or kvflow rebuilds it instead of reusing the old conversion.
    transformers rebuilds a GGUF tokenizer through ``gguf.GGUFReader``, minutes for a 262k
    vocabulary (Gemma 3) on a small CPU; a saved ``tokenizer.json`` loads in about a second."""
    import hashlib

    import transformers

    from kvflow.config import cache_dir

    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|"
           f"{transformers.__version__}|{_CACHE_FORMAT}").encode()
    return os.path.join(cache_dir(), "tokenizers", hashlib.sha256(key).hexdigest()[:24])


def _save_tokenizer_cache(tokenizer: Any, folder: str) -> None:
    """Save into a temporary folder and rename it into place (best effort: a read-only cache
    only costs the next load its speed)."""
    import shutil
    import tempfile

    tmp = None
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(folder))
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, folder)
    except OSError:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
