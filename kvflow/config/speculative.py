"""Speculative decoding (``SpeculativeConfig``, vLLM's keys)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvflow.config import cpu_limits
from kvflow.config.options import check_choices, json_config_dict, unknown_fields

SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "deepseek_mtp")
HEAD_METHODS = ("eagle", "eagle3", "deepseek_mtp")  # heads fed the target's hidden states


# A draft model's "auto" settings on a CPU (README, docs/benchmarks.md issue 17: with the
# Qwen2.5-Coder pair a pass cost 0.18 of a target step instead of 0.45)
CPU_DRAFT_QUANTIZATION = "int8"
CPU_DRAFT_VOCAB_SIZE = 32768


@dataclass
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config`` JSON / ``LLM(speculative_config=...)``,
    vLLM's keys): a proposer guesses up to ``num_speculative_tokens`` next tokens per request,
    the target model checks them all in one step, and rejection sampling keeps exactly the
    tokens the target would have produced (see kvflow/spec_decode/).

    Attributes:
        method: ``ngram`` (prompt lookup: the tokens that followed the latest earlier occurrence
            of the last n tokens; no model) or ``draft_model`` (a smaller model sharing the
            target's tokenizer) or ``eagle`` (an EAGLE-1 head, Li et al. 2024 arXiv 2401.15077:
            one decoder layer fed the target's final hidden states; kvflow/spec_decode/
            eagle.py) or ``eagle3`` (an EAGLE-3 head, Li et al. 2025 arXiv 2503.01840: fed
            ``fc`` of three target layers' residual streams, with its own draft vocabulary;
            kvflow/models/eagle3.py) or ``deepseek_mtp`` (DeepSeek-V3's
            multi-token-prediction layer, the same way; ``model`` defaults to the target). Left
            out (None), as vLLM infers it: ``draft_model`` if ``model`` is given (``ngram``
            for vLLM's ``model`` "ngram" / "[ngram]"); with neither, refused as vLLM refuses
            it (``--spec-tokens`` alone names no proposer).
        num_speculative_tokens: most draft tokens per request and step (K).
        model: the draft model (``draft_model``) or EAGLE head checkpoint (``eagle``, vLLM's
            ``EagleLlamaForCausalLM`` layout; ``eagle3``, ``Eagle3LlamaForCausalLM``'s): a
            packaged name, HF folder, GGUF or Hub id; its tokenizer must be the target's (refused at start-up otherwise:
            kvflow/spec_decode/draft_tokenizer.py).
        prompt_lookup_max / prompt_lookup_min: n-gram sizes tried, longest first (``ngram``).
        quantization: the draft model's weight quantization: ``int8``, ``int4``, ``none`` (or
            null: as loaded); default ``auto``: int8 on a CPU, none elsewhere. Only the draft's
            speed changes: verification keeps the target's output exact.
        adaptive: choose each request's K per step from its running acceptance rate and a
            measured step-cost model (speculation off when verification costs more than it
            saves); False: always ``num_speculative_tokens`` when the proposer has them.
        draft_cpu_threads: CPU threads of the draft model's passes (``draft_model`` on a
            CPU); default: the faster, measured at start-up and while serving, of the engine's
            count and 1 (on cores shared with other processes one thread ran a 0.5B draft
            pass 9x faster than two).
        draft_vocab_size: FR-Spec (``draft_model``): the draft's LM head computes only the
            logits of this many lowest token ids (a byte-level BPE's merge ranks: the most
            frequent tokens), the end tokens of the draft and of the target (its
            generation_config.json / config.json ``eos_token_id``), each request's stop ids
            (its EOS, ``stop_token_ids``) and the tokens already in the request's
            context; ``0`` or null: the whole vocabulary; default ``auto``: 32768 on a CPU, the
            whole vocabulary elsewhere. The output stays exact (the draft's distribution is
            zero outside the subset; kvflow/spec_decode/draft_vocab.py).

    Raises:
        ValueError: from the constructor for an unknown method, neither ``method`` nor
            ``model`` given, a missing or empty draft model, a size out of range,
            ``draft_cpu_threads`` above the CPUs of the process's affinity mask and cgroup
            CPU quota (:func:`~kvflow.config.cpu_limits.check_thread_limit`), or a key of
            the other method (``_check_method_keys``).
    """

    method: str | None = None
    num_speculative_tokens: int = 4
    model: str | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    quantization: str | None = "auto"
    adaptive: bool = True
    draft_cpu_threads: int | None = None
    draft_vocab_size: int | str | None = "auto"

    def __post_init__(self) -> None:
        try:
            check_choices(self)
        except ValueError as e:
            raise ValueError(f"speculative_config {e}") from None
        self._infer_method()
        self._check_proposer()
        self._check_method_keys()
        if self.method in ("draft_model", "eagle", "eagle3") and not self.model:
            raise ValueError(f"speculative_config method={self.method!r} needs 'model' (the "
                             "draft model's or EAGLE head's name or path)")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min={self.prompt_lookup_min} "
                             f"and prompt_lookup_max={self.prompt_lookup_max} need "
                             "1 <= min <= max")
        self._check_draft_cpu_threads()
        self._check_draft_vocab_size()
        if self.quantization not in (None, "auto", "none", "int8", "int4"):
            raise ValueError(f"speculative_config quantization={self.quantization!r} is "
                             "invalid; choose int8, int4, none (or null) or auto")

    def _check_proposer(self) -> None:
        """The method (once inferred), K and the model's name: a known method, K in [1, 16],
        a model name that is not blank and no model for ``ngram``.

        Raises:
            ValueError: naming the key and what it must be.
        """
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method={self.method!r} is invalid; choose "
                             f"one of {list(SPEC_METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"speculative_config num_speculative_tokens="
                             f"{self.num_speculative_tokens} must be in [1, 16]")
        if self.model is not None and not self.model.strip():
            raise ValueError(f"speculative_config model={self.model!r} is empty: name the draft "
                             "model, or leave 'model' out for n-gram lookup")
        if self.method == "ngram" and self.model:
            raise ValueError(f"speculative_config model={self.model!r} applies to method="
                             "'draft_model' only (n-gram lookup uses no model)")

    def _check_draft_cpu_threads(self) -> None:
        """``draft_cpu_threads``: None, or an integer >= 1 the process may run
        (:func:`~kvflow.config.cpu_limits.check_thread_limit`).

        Raises:
            ValueError: naming ``draft_cpu_threads`` for anything else.
        """
        if self.draft_cpu_threads is not None and (
                isinstance(self.draft_cpu_threads, bool) or
                not isinstance(self.draft_cpu_threads, int) or self.draft_cpu_threads < 1):
            raise ValueError(f"speculative_config draft_cpu_threads="
                             f"{self.draft_cpu_threads!r} must be an integer >= 1")
        if self.draft_cpu_threads is not None:
            cpu_limits.check_thread_limit(
                self.draft_cpu_threads, cpu_limits.usable_cpus(), cpu_limits.cgroup_cpu_limit(),
                name="speculative_config draft_cpu_threads",
                default="the faster, as measured, of the engine's count and 1")

    def _check_draft_vocab_size(self) -> None:
        """``draft_vocab_size``: None, "auto", 0 or an integer >= 1, the last only with
        ``draft_model`` (a proposer with an LM head of its own to cut).

        Raises:
            ValueError: naming ``draft_vocab_size`` for anything else.
        """
        vocab = self.draft_vocab_size
        if vocab not in (None, "auto") and (
                isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 0):
            raise ValueError(f"speculative_config draft_vocab_size={vocab!r} must be an "
                             "integer >= 1, 0 or null (the whole vocabulary) or 'auto'")
        if vocab not in (None, "auto", 0) and self.method != "draft_model":
            why = "an n-gram proposer has no LM head" if self.method == "ngram" else \
                f"the {self.method} head drafts over the vocabulary its checkpoint and target set"
            raise ValueError(f"speculative_config draft_vocab_size={vocab} applies to "
                             f"method='draft_model' only ({why})")

    def _infer_method(self) -> None:
        """A ``method`` left out, as vLLM's ``SpeculativeConfig`` infers it: ``ngram`` for
        ``model`` "ngram" / "[ngram]" (vLLM's older spelling, the model then unset), else
        ``draft_model`` when a ``model`` is named.

        Raises:
            ValueError: with neither ``method`` nor ``model`` (vLLM: "num_speculative_tokens
                was provided but without speculative model."), naming the flags that set
                them, rather than running n-gram lookup nobody asked for.
        """
        if self.method is not None:
            return
        if self.model in ("ngram", "[ngram]"):
            self.method, self.model = "ngram", None
        elif self.model is not None:
            self.method = "draft_model"
        else:
            raise ValueError(
                "speculative_config names no proposer: neither 'method' nor 'model' is given "
                "(vLLM refuses it too: \"num_speculative_tokens was provided but without "
                "speculative model.\"); give --spec-method M (--speculative-config's "
                "'method': ngram for n-gram prompt lookup, or "
                f"{', '.join(SPEC_METHODS[1:-1])} or {SPEC_METHODS[-1]}) or --spec-model NAME "
                "(its 'model': a draft model)")

    def _check_method_keys(self) -> None:
        """Keys of the other method, set to something they would do, are refused rather
        than ignored: a draft model's quantization and threads with ``ngram``, n-gram sizes
        other than the defaults with ``draft_model``.

        Raises:
            ValueError: naming the key and the method it applies to.
        """
        if self.method == "ngram":
            wrong = [f"quantization={self.quantization!r}"] \
                if self.quantization in ("int8", "int4") else []
            wrong += [f"draft_cpu_threads={self.draft_cpu_threads!r}"] \
                if self.draft_cpu_threads is not None else []
            if wrong:
                raise ValueError(f"speculative_config {', '.join(wrong)} applies to method="
                                 "'draft_model' only (n-gram lookup runs no model)")
        elif self.method in HEAD_METHODS and \
                self.quantization in ("int8", "int4"):
            raise ValueError(f"speculative_config quantization={self.quantization!r} applies "
                             f"to method='draft_model' only (the {self.method} head runs as "
                             "loaded)")
        elif (self.prompt_lookup_max, self.prompt_lookup_min) != (4, 2):
            raise ValueError(f"speculative_config prompt_lookup_max={self.prompt_lookup_max} "
                             f"/ prompt_lookup_min={self.prompt_lookup_min} apply to method="
                             "'ngram' only (a draft model proposes without n-gram lookup)")

    def summary(self) -> str:
        """What the engine's start-up line says of speculative decoding (vLLM's engine
        config line shows its ``SpeculativeConfig(method, model, num_spec_tokens)``), e.g.
        ``method ngram, model none, num_speculative_tokens 3, adaptive true, n-gram sizes
        4..2``."""
        model = self.model or ("none" if self.method == "ngram" else "the target's")
        sizes = f", n-gram sizes {self.prompt_lookup_max}..{self.prompt_lookup_min}" \
            if self.method == "ngram" else ""
        return (f"method {self.method}, model {model}, num_speculative_tokens "
                f"{self.num_speculative_tokens}, adaptive {str(self.adaptive).lower()}{sizes}")

    def draft_options(self, device_type: str, prequantized: bool = False,
                      deterministic: bool = False) -> tuple[str | None, int | None]:
        """The draft model's ``(quantization, draft_vocab_size)`` on a device of
        ``device_type`` (``"cpu"``, ``"cuda"``, ...): ``auto`` resolved (a CPU: int8 and
        32768; elsewhere none; a ``prequantized`` checkpoint keeps its own scheme, and a
        ``deterministic`` engine its weights, whose quantized GEMMs would have no
        batch-invariant kernel: None), ``none`` / null / 0 as None (as loaded / the whole
        vocabulary)."""
        cpu = device_type == "cpu"
        quant = self.quantization
        if quant == "auto":
            quant = CPU_DRAFT_QUANTIZATION if cpu and not (prequantized or deterministic) \
                else None
        if self.method in HEAD_METHODS:  # one layer: as loaded, its own vocabulary
            return None, None
        vocab = self.draft_vocab_size
        if vocab == "auto":
            vocab = CPU_DRAFT_VOCAB_SIZE if cpu else None
        return (None if quant == "none" else quant), (vocab or None)

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict | str | None
                   ) -> SpeculativeConfig | None:
        """A config from a dict, a JSON object string (the flag's form) or None (off; so is
        the JSON text ``null``).

        Raises:
            ValueError: for text that is not a JSON object (an empty string too: leave the
                flag out to run without speculation), an unknown key (named), or neither
                ``method`` nor ``model`` (a missing ``method`` is ``draft_model`` when
                ``model`` is given: :meth:`_infer_method`).
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str) and not value.strip():
            raise ValueError("speculative_config is empty, which is not valid JSON: give "
                             'a JSON object such as {"method": "ngram", '
                             '"num_speculative_tokens": 4}, or leave it out to run '
                             "without speculative decoding")
        value = json_config_dict("speculative_config", value,
                                 '{"method": "ngram", "num_speculative_tokens": 4}')
        if value is None:
            return None
        unknown, known = unknown_fields(cls, value)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; valid: {known}")
        return cls(**value)


# vLLM's shorthand flags of --speculative-config: (flag, keyword, the config key it sets)
SPEC_SHORTHANDS = (("--spec-method", "spec_method", "method"),
                   ("--spec-model", "spec_model", "model"),
                   ("--spec-tokens", "spec_tokens", "num_speculative_tokens"))


def merge_spec_shorthands(value: SpeculativeConfig | dict | str | None,
                          shorthands: dict[str, Any]) -> SpeculativeConfig | dict | str | None:
    """``speculative_config`` with vLLM's shorthands (``spec_method``, ``spec_model``,
    ``spec_tokens``: ``shorthands``' values that are not None) set as its ``method``,
    ``model`` and ``num_speculative_tokens`` keys, as vLLM's
    ``EngineArgs.create_speculative_config`` sets them; a shorthand alone starts an empty
    config. ``value`` is returned as it is when no shorthand is given.

    Raises:
        ValueError: for a key given both ways (vLLM: mutually exclusive), or shorthands
            beside a ``SpeculativeConfig`` object (give its fields there).
    """
    given = [(flag, key, shorthands[name]) for flag, name, key in SPEC_SHORTHANDS
             if shorthands.get(name) is not None]
    if not given:
        return value
    if isinstance(value, SpeculativeConfig):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"{given[0][0]} beside a SpeculativeConfig object: set its fields there instead")
    merged = dict(json_config_dict("speculative_config", value,
                                   '{"method": "ngram", "num_speculative_tokens": 4}')
                  or {}) if value is not None else {}
    for flag, key, setting in given:
        if key in merged:
            raise ValueError(f"{flag} and --speculative-config's {key!r} are mutually "
                             "exclusive (both set it): give one")
        merged[key] = setting
    return merged
