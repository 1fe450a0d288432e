"""Which model runs and how its weights are read (``ModelConfig``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kvflow.config.options import check_choices, human_readable_int_or_auto, json_object, opt
from kvflow.config.pooler_config import parse_pooler_config
from kvflow.logits_process import load_logits_processors

HF_OVERRIDES_FLAG = "--hf-overrides (hf_overrides)"

# vLLM's spellings of kvflow's values (vLLM's ModelDType and --generation-config): field ->
# {vLLM's value: kvflow's}; the config holds kvflow's after its checks
VLLM_VALUE_ALIASES = MappingProxyType({
    "dtype": MappingProxyType({"half": "float16", "float": "float32"}),
    "generation_config": MappingProxyType({"vllm": "none"})})

# vLLM's --logprobs-mode values (vLLM 0.10.2+); the first is the default
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def parse_hf_overrides(value: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """The overrides as a dict: a dict as given, JSON object text parsed (the CLI and config
    file form), None / ``null`` / ``{}`` as None (nothing to merge).

    Raises:
        ValueError: naming the flag, for text that is not valid JSON (with the position) or a
            value that is not a JSON object (a list, a string, a number).
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{HF_OVERRIDES_FLAG} is not valid JSON: {e}; give a JSON object "
                             'such as \'{"architectures": ["Qwen3ForSequenceClassification"]}\'') \
                from None
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"{HF_OVERRIDES_FLAG} must be a JSON object of config.json keys, got "
            f"{json.dumps(value)[:100]} ({type(value).__name__})")
    return value or None


# generation_config.json keys --override-generation-config may set (the sampling defaults read)
GENERATION_OVERRIDE_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                            "presence_penalty", "frequency_penalty", "max_new_tokens")


def _generation_overrides(value: Any) -> dict[str, Any] | None:
    """``override_generation_config`` as a dict (from JSON text or a dict); None stays None.

    Raises:
        ValueError: for text that is not a JSON object, or a key kvflow does not read from
            generation_config.json (it would be ignored).
    """
    value = json_object("override_generation_config", value, '{"temperature": 0.5}')
    if value is None:
        return None
    unknown = sorted(set(value) - set(GENERATION_OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"override_generation_config sets {unknown}, which kvflow does not "
                         f"read from generation_config.json; it reads "
                         f"{list(GENERATION_OVERRIDE_KEYS)}")
    return value


@dataclass
class ModelConfig:
    """Which model runs and how its config, tokenizer and weights are read.

    Raises:
        ValueError: from the constructor for a value out of range or a combination that
            leaves a setting unread.
    """

    model: str = opt("SmolLM2-135M-Instruct",
                      "packaged model name, HF folder, path to a .gguf file, or Hugging Face "
                      "Hub repo id org/name[@revision]")
    revision: str | None = opt(None, "Hub model revision: a branch, tag or commit (as "
                                "org/name@revision; Hub repo ids only)")
    tokenizer_revision: str | None = opt(
        None, "Hub revision of the tokenizer (a branch, tag or commit): of --tokenizer's repo, "
        "else of the model's (vLLM's flag of the same name); Hub repo ids only (default: "
        "--revision's)", metavar="REVISION")
    hf_token: str | bool | None = opt(
        None, "Hugging Face Hub token of the model, tokenizer and draft model downloads; the "
        "flag alone: the token 'hf auth login' stored (vLLM's flag of the same name; default: "
        "$HF_TOKEN, else the stored token)", nargs="?", const=True, metavar="TOKEN")
    download_dir: str | None = opt(None, "huggingface_hub cache folder for Hub models "
                                    "(default: $HF_HUB_CACHE, else $HF_HOME/hub)")
    tokenizer: str | None = opt(None, "tokenizer: folder, .gguf file, packaged model name or "
                                "Hub repo id org/name[@revision] (default: the model's own)")
    task: str = opt("auto", "what the model serves: generate (text), embed (one vector per "
                     "prompt: /v1/embeddings, LLM.embed), score (a cross-encoder's score per "
                     "text pair: /v1/score, /v1/rerank, LLM.score), classify (a "
                     "*ForSequenceClassification model's class probabilities per prompt: "
                     "/classify, LLM.classify), token_classify (a *ForTokenClassification "
                     "model's class probabilities per prompt token: /pooling, LLM.encode), "
                     "or auto (score for *ForSequenceClassification, token_classify for "
                     "*ForTokenClassification, embed for encoder and LM-head-less "
                     "architectures and sentence-transformers folders)",
                     choices=["auto", "generate", "embed", "score", "classify",
                              "token_classify"])
    runner: str = opt("auto", "vLLM's replacement of --task: generate (--task generate), "
                      "pooling (with --convert auto: the architecture's own pooling task, "
                      "embed for a text generation model, as vLLM converts it), or auto "
                      "(--task auto); vLLM's draft is refused (a draft model runs inside "
                      "--speculative-config); not with --task", choices=["auto", "generate",
                                                                        "pooling", "draft"])
    convert: str = opt("auto", "vLLM's model conversion, with --runner: embed (--task embed), "
                       "classify (--task classify), none (no conversion: under --runner "
                       "pooling the architecture must pool), or auto; embed and classify "
                       "are refused with --runner generate; not with --task",
                       choices=["auto", "none", "embed", "classify"])
    dtype: str = opt("auto", "compute dtype (also vLLM's half = float16 and float = float32)",
                     choices=["auto", "float32", "bfloat16", "float16", "half", "float"])
    max_model_len: int | None = opt(None, "context length in tokens (default, also -1 or "
                                    "auto as in vLLM: the model's, capped to what the KV "
                                    "cache holds); vLLM's spellings 2k = 2000, 2K = 2048, "
                                    "25.6k = 25600", type=human_readable_int_or_auto)
    seed: int = opt(0, "seed for unseeded random sampling and dummy weights (an integer in "
                     "[-2**63, 2**64); a negative one wraps, as torch's generators take it)")
    load_format: str = opt("auto", "weights: auto (from files: a folder's safetensors or a "
                            ".gguf file), safetensors (a folder's safetensors files only, "
                            "as vLLM's) or dummy (random init; refused before anything is built "
                            "when config.json's sizes need more memory than is available); "
                            "vLLM's pt is refused (kvflow "
                            "reads no PyTorch .bin/.pt model checkpoint)",
                            choices=["auto", "safetensors", "dummy", "pt"])
    disable_sliding_window: bool = opt(False, "cap max_model_len at the model's sliding "
                                       "window, so its sliding-window layers attend to every "
                                       "key (vLLM's flag of the same name; a larger "
                                       "--max-model-len is refused; no effect on a model "
                                       "without one)")
    skip_tokenizer_init: bool = opt(False, "do not load a tokenizer (token-id prompts only; "
                                      "refused with --tokenizer)")
    enable_prompt_embeds: bool = opt(False, "accept prompts given as embedding rows instead "
                                       "of token ids (LLM.generate({'prompt_embeds': "
                                       "tensor}), /v1/completions prompt_embeds); refused "
                                       "with speculative decoding")
    enable_sleep_mode: bool = opt(False, "allow LLM.sleep / LLM.wake_up (and the server's "
                                    "/sleep, /wake_up under KVFLOW_SERVER_DEV_MODE=1): free "
                                    "the KV cache (and offload or drop the weights) while "
                                    "idle, as vLLM's flag of the same name")
    generation_config: str = opt("auto", "sampling defaults: auto (temperature, top_p, top_k, "
                                  "min_p, repetition_penalty, max_new_tokens from the model "
                                  "folder's generation_config.json; a request's own values "
                                  "win) or none (also vLLM's spelling vllm)",
                                  choices=["auto", "none", "vllm"])
    quantization: str | None = opt(
        None, "weight quantization: none, int8 (weight-only, per channel), int4 (weight-only, "
        "group-wise), fp8 (W8A8: FP8 weights with per-tensor scales, activations per token; "
        "on a block-wise FP8 checkpoint such as DeepSeek-V3's, reads it: dequantized into "
        "--dtype at load), "
        "gguf (keep a .gguf file's quantized blocks, dequantized per tile in the GEMM), "
        "compressed-tensors (a pre-quantized FP8/INT8 checkpoint; read from its config.json), "
        "gptq / awq (a GPTQ or AWQ 4-bit checkpoint; also vLLM's gptq_marlin / awq_marlin) "
        "(default: the checkpoint's quantization_config, else none; a .gguf file is "
        "dequantized at load)",
        choices=[None, "none", "int8", "int4", "fp8", "gguf", "compressed-tensors", "gptq",
                 "awq", "gptq_marlin", "awq_marlin"])
    quantization_group_size: int | None = opt(
        None, "input columns per scale for int4 (int4 only; default: 32, and refused, even "
        "as 32, with another --quantization)", choices=[None, 32, 64, 128, 256])
    # the default is None: opt() builds no shared mutable value (ruff cannot see that)
    hf_overrides: dict | str | None = opt(  # noqa: RUF009
        None, "a JSON object merged into the model's config.json before it is checked and "
        "read (vLLM's flag; an object for a nested config such as text_config is merged into "
        "it, any other value replaces the key), e.g. '{\"architectures\": "
        "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", \"yes\"], "
        "\"is_original_qwen3_reranker\": true}' (default: none)", metavar="JSON")
    pooler_config: dict | str | None = opt(  # noqa: RUF009 (a dict once parsed)
        None, "override the model's pooling (vLLM 0.32's flag): a JSON object of vLLM's "
        "PoolerConfig fields, e.g. '{\"pooling_type\": \"MEAN\"}': pooling_type / "
        "seq_pooling_type (CLS, MEAN, LAST), use_activation (embeddings: L2 normalization; "
        "score / classify: the head's activation), dimensions (the default Matryoshka "
        "size), logit_mean / logit_sigma (calibrate a classifier's logits before its "
        "activation); unknown keys and those kvflow does not run (task, step pooling, "
        "chunked processing, max_embed_len, normalize) are refused (default: the model "
        "folder's pooling)", metavar="JSON")

    trust_remote_code: bool = opt(False, "let transformers run the model repo's own Python "
                                  "code (auto_map) to read its config and tokenizer, as "
                                  "vLLM's flag of the same name; kvflow still runs the model "
                                  "itself with its own code, so an architecture kvflow does "
                                  "not implement stays refused; a Hub download fetches no "
                                  ".py files (download the repo to use its code)")
    tokenizer_mode: str = opt("auto", "auto or hf: transformers' tokenizer (the fast one: "
                               "transformers 5 loads no other); vLLM's other modes (slow, "
                               "mistral, custom, ...) are refused", metavar="MODE")
    override_generation_config: str | dict | None = opt(  # noqa: RUF009 (a dict once parsed)
        None, "sampling defaults as a JSON object of generation_config.json keys "
        "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), e.g. "
        "'{\"temperature\": 0.5}': merged over the model's file under --generation-config "
        "auto, the only defaults under none (vLLM's flag of the same name)")

    logprobs_mode: str = opt(
        "raw_logprobs", "what logprobs and prompt_logprobs report (vLLM's flag): raw_logprobs "
        "(the log-softmax of the model's logits, only a structured-output mask applied), "
        "raw_logits (those logits), processed_logprobs (the log-softmax of what the sampler "
        "samples from: after logit_bias, allowed_token_ids, bad_words, min_tokens, the "
        "penalties, custom logits processors, temperature, min_p, top_k and top_p; a greedy "
        "request's stop before temperature), processed_logits (those logits); prompt "
        "logprobs are raw either way (logits in the *_logits modes)",
        choices=list(LOGPROBS_MODES))
    logits_processors: list | None = opt(  # noqa: RUF009 (the default is None)
        None, "custom logits processors (vLLM v1's engine-level kind): classes that "
        "subclass kvflow.logits_process.LogitsProcessor, as 'module.path:ClassName' (LLM() "
        "takes the classes too); requests pass them arguments in SamplingParams.extra_args "
        "(vllm_xargs on the server)", nargs="+", metavar="MODULE:CLASS")
    logits_processor_plugins: list | None = opt(  # noqa: RUF009 (the default is None)
        None, "the class paths of the installed logits processor plugins (entry point group "
        "kvflow.logits_processors), found at start-up once the task is known, for a "
        "generating engine without speculative decoding ([] otherwise; None: not looked "
        "for yet)", cli=False)

    def __post_init__(self) -> None:
        """Checks each field (``hf_overrides``, ``pooler_config`` and
        ``override_generation_config`` given as JSON text become dicts, or None; vLLM's spellings of ``dtype`` and
        ``generation_config`` become kvflow's: ``VLLM_VALUE_ALIASES``).

        Raises:
            ValueError: naming the field, for a value of the wrong type or out of range,
                ``hf_overrides`` / ``pooler_config`` / ``override_generation_config`` that is
                not a JSON object (or sets a key kvflow does not read), ``logits_processors`` naming what does
                not import or is not a ``LogitsProcessor`` subclass, a ``tokenizer_mode``
                other than auto /
                hf, ``load_format="pt"`` (no PyTorch checkpoint reader), or two fields that
                conflict.
        """
        self.override_generation_config = _generation_overrides(self.override_generation_config)
        if isinstance(self.logits_processors, (str, type)):
            self.logits_processors = [self.logits_processors]
        if self.logits_processors is not None:  # a bad class path fails at start-up
            self.logits_processors = list(self.logits_processors) or None
            load_logits_processors(self.logits_processors)
        check_choices(self)
        self._apply_vllm_spellings()
        self.hf_overrides = parse_hf_overrides(self.hf_overrides)
        self.pooler_config = parse_pooler_config(self.pooler_config)
        if self.tokenizer_mode not in ("auto", "hf"):
            raise ValueError(f"tokenizer_mode={self.tokenizer_mode!r} is not available: kvflow "
                             "loads tokenizers through transformers, whose version 5 always "
                             "loads the fast tokenizer (give auto or hf)")
        if self.quantization_group_size is not None and self.quantization != "int4":
            raise ValueError(f"quantization_group_size={self.quantization_group_size} applies "
                             "to quantization='int4' only (quantization="
                             f"{self.quantization!r})")
        if self.tokenizer is not None and self.skip_tokenizer_init:  # it would go unread
            raise ValueError(f"tokenizer={self.tokenizer!r} is not loaded with "
                             "skip_tokenizer_init=True; give one of them")
        if not -2**63 <= self.seed < 2**64:  # what torch.Generator.manual_seed takes
            raise ValueError(f"seed={self.seed} is out of range: torch's generators take an "
                             "integer in [-2**63, 2**64)")
        self._check_runner()
        self._check_tokenizer_revision()
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 1 (or -1 / unset "
                             "for the model's own)")

    def _apply_vllm_spellings(self) -> None:
        """vLLM's values as kvflow's (``VLLM_VALUE_ALIASES``: ``dtype`` half / float,
        ``generation_config`` vllm; ``max_model_len`` -1, vLLM's auto-fit, is None, which
        kvflow caps to the KV cache as vLLM fits it), and vLLM's ``load_format`` pt refused.

        Raises:
            ValueError: for ``load_format="pt"``, naming the flag and why.
        """
        for name, aliases in VLLM_VALUE_ALIASES.items():
            setattr(self, name, aliases.get(getattr(self, name), getattr(self, name)))
        if self.max_model_len == -1:  # vLLM's auto-fit: the model's length, cache-capped
            self.max_model_len = None
        if self.load_format == "pt":
            raise ValueError("load_format='pt' is not available: kvflow "
                             "reads a model's weights from safetensors files or a .gguf "
                             "file, not from PyTorch .bin/.pt checkpoints; give auto or "
                             "safetensors (transformers' save_pretrained writes safetensors)")

    def _check_runner(self) -> None:
        """Refuse vLLM's ``runner`` / ``convert`` values kvflow cannot serve, and their use
        beside ``task`` (two ways to say one thing).

        Raises:
            ValueError: naming the flags and why.
        """
        if self.runner == "auto" and self.convert == "auto":
            return
        if self.task != "auto":
            raise ValueError(f"--task {self.task} with --runner {self.runner} --convert "
                             f"{self.convert}: both choose what the model serves; give "
                             "--runner / --convert (vLLM's) or --task")
        if self.runner == "draft":
            raise ValueError("--runner draft is not available: kvflow runs a draft model "
                             "only inside --speculative-config (its 'model' key)")
        if self.runner == "generate" and self.convert in ("embed", "classify"):
            raise ValueError(f"--runner generate with --convert {self.convert} cannot be "
                             f"served: a model converted to {self.convert} pools, it does "
                             f"not generate (give --runner pooling, or --convert none)")

    def _check_tokenizer_revision(self) -> None:
        """Refuse a ``tokenizer_revision`` with no tokenizer to load, and an empty
        ``hf_token`` (whether ``tokenizer`` / ``model`` is a Hub repo id it can apply to is
        checked where the tokenizer's source is chosen:
        ``kvflow.models.tokenizer_source``).

        Raises:
            ValueError: naming the field and why.
        """
        if isinstance(self.hf_token, str) and not self.hf_token.strip():
            raise ValueError("hf_token is empty: give a token, or the flag alone for the "
                             "stored one")
        if self.tokenizer_revision is not None and self.skip_tokenizer_init:
            raise ValueError(f"tokenizer_revision={self.tokenizer_revision!r} with "
                             "skip_tokenizer_init=True: no tokenizer is loaded; give one")

    @property
    def requested_task(self) -> str:
        """The task asked for, for :func:`kvflow.models.model_task.resolve_task`: ``task``,
        or what vLLM's ``runner`` / ``convert`` say (``convert`` embed / classify: that
        task; ``runner`` generate: generate; ``runner`` pooling: ``"pooling"`` with convert
        auto (the architecture's pooling task, embed for a generating one),
        ``"pooling_native"`` with convert none (the architecture's, which must pool))."""
        if self.convert in ("embed", "classify"):
            return self.convert
        if self.runner == "generate":
            return "generate"
        if self.runner == "pooling":
            return "pooling" if self.convert == "auto" else "pooling_native"
        return self.task

    @property
    def task_flags(self) -> str:
        """The flags that chose the task, for messages naming them as the user gave them:
        vLLM's ``--runner R`` / ``--convert C`` (those not auto) when either was given,
        else ``--task``."""
        given = [f"--{name} {value}" for name, value in (("runner", self.runner),
                                                          ("convert", self.convert))
                 if value != "auto"]
        return " ".join(given) or "--task"

    @property
    def tokenizer_options(self) -> dict[str, Any]:
        """``AutoTokenizer.from_pretrained`` keyword arguments: ``trust_remote_code``."""
        return {"trust_remote_code": self.trust_remote_code}

    def custom_logits_processors(self) -> list:
        """The engine's custom logits processors: the installed plugins'
        (``logits_processor_plugins``) first, then the configured ones
        (``logits_processors``; one named by both runs once, as the plugin)."""
        plugins = list(self.logits_processor_plugins or [])
        return plugins + [p for p in self.logits_processors or [] if p not in plugins]
