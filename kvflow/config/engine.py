"""All configuration of one engine (``EngineConfig``): the sections, the checks across them,
and the mapping from ``LLM(**kwargs)`` and CLI flags to sections."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import logging
from dataclasses import dataclass, field, fields
from typing import Any

from kvflow.config import cpu_limits
from kvflow.config.cache import CacheConfig
from kvflow.config.deterministic import check_config as check_deterministic
from kvflow.config.device import DeviceConfig
from kvflow.config.kv_events import KVEventsConfig
from kvflow.config.kv_transfer import KVTransferConfig
from kvflow.config.lora import LoRAConfig
from kvflow.config.model import ModelConfig
from kvflow.config.multimodal import MultiModalConfig
from kvflow.config.options import add_field_arg
from kvflow.config.parallel import ParallelConfig
from kvflow.config.reasoning import REASONING_OPTIONS
from kvflow.config.scheduler import SchedulerConfig
from kvflow.config.speculative import (
    HEAD_METHODS,
    SPEC_SHORTHANDS,
    SpeculativeConfig,
    merge_spec_shorthands,
)
from kvflow.config.structured import StructuredOutputConfig
from kvflow.logits_process import LOGITS_PROCESSORS_GROUP, plugin_logits_processors
from kvflow.utils.close_names import did_you_mean

logger = logging.getLogger(__name__)

_SECTIONS = {"model_config": ModelConfig, "cache_config": CacheConfig,
             "scheduler_config": SchedulerConfig, "device_config": DeviceConfig,
             "parallel_config": ParallelConfig, "multimodal_config": MultiModalConfig,
             "lora_config": LoRAConfig, "structured_output_config": StructuredOutputConfig}

# sections given as one JSON object (a dict, a JSON string or the section's class)
_JSON_SECTIONS = ("speculative_config", "kv_events_config", "kv_transfer_config")
# vLLM's shorthands of speculative_config's keys (spec_method, spec_model, spec_tokens)
_SPEC_KEYWORDS = tuple(name for _, name, _ in SPEC_SHORTHANDS)
# what --help says of a left-out speculative method (SpeculativeConfig._infer_method)
_SPEC_METHOD_DEFAULT = "draft_model when model is given, else required"


@dataclass
class EngineConfig:
    """All configuration of one engine instance."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    multimodal_config: MultiModalConfig = field(default_factory=MultiModalConfig)
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)
    structured_output_config: StructuredOutputConfig = field(
        default_factory=StructuredOutputConfig)
    kv_events_config: KVEventsConfig | None = None
    kv_transfer_config: KVTransferConfig | None = None

    def __post_init__(self) -> None:
        """Checks across sections (``speculative_config`` given as a dict or JSON string
        becomes a SpeculativeConfig, ``kv_events_config`` a KVEventsConfig).

        Raises:
            ValueError: for a swap_space given (any size, the default's too) without
                preemption_mode 'swap'; for context parallelism with a block size it does not divide or a
                quantized KV cache; for speculative decoding with pipeline or context
                parallelism, async scheduling or custom logits processors; for async
                scheduling with any executor but uni (several ranks, or
                distributed_executor_backend mp or ray on one rank; checked here, before any
                worker starts); for ``cpu_threads`` above the CPUs this process may use or
                a ``cpu_threads_bind`` CPU outside its affinity mask (``_check_cpu_threads``);
                for ``deterministic`` with settings it cannot honour
                (:func:`kvflow.config.deterministic.config_reasons`).
        """
        self._check_speculative()
        self._check_cpu_threads()
        check_deterministic(self)
        self.kv_events_config = KVEventsConfig.from_value(self.kv_events_config)
        self._check_kv_transfer()
        cc, mode = self.cache_config, self.scheduler_config.preemption_mode
        if mode != "swap" and cc.swap_space is not None:  # only the swap host pool reads it
            raise ValueError(f"--swap-space {cc.swap_space} (swap_space) sizes the host pool "
                             f"of --preemption-mode swap, and this engine preempts by "
                             f"{mode}, which keeps none: add --preemption-mode swap "
                             "(preemption_mode='swap'), or leave --swap-space out")
        if self.scheduler_config.async_scheduling and \
                self.parallel_config.executor_backend != "uni":
            raise ValueError(f"--async-scheduling needs the uni executor (one rank in the "
                             f"engine's process); {self._why_not_uni()}")
        cp, cc = self.parallel_config.context_parallel_size, self.cache_config
        if cp > 1 and cc.block_size % cp:
            raise ValueError(f"block_size={cc.block_size} must be a multiple of "
                             f"context_parallel_size={cp} (each rank holds block_size / {cp} "
                             "tokens of every block)")
        if cp > 1 and cc.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={cc.kv_cache_dtype!r} is not available with "
                             f"context_parallel_size={cp}")

    def _check_cpu_threads(self) -> None:
        """``cpu_threads`` (each worker process's threads) refused above the CPUs of this
        process's affinity mask and cgroup quota
        (:func:`~kvflow.config.cpu_limits.check_thread_limit`), and a ``cpu_threads_bind``
        list naming a CPU outside the mask (:func:`~kvflow.config.cpu_limits.check_bind_cpus`,
        every worker's part), before any model loads; the engine checks both again where it
        starts (``kvflow.kernels.cpu_threads.check_cpu_threads``, for engines built without
        an EngineConfig). Not checked with Ray, whose workers may run on other machines, nor
        for a device other than cpu or auto, which refuses the options as CPU-only
        (``kvflow.core.unread_options``)."""
        dc = self.device_config
        if dc.device not in ("auto", "cpu") or self.parallel_config.executor_backend == "ray":
            return
        allowed = cpu_limits.usable_cpus()
        if dc.cpu_threads is not None:
            cpu_limits.check_thread_limit(dc.cpu_threads, allowed, cpu_limits.cgroup_cpu_limit())
        bound = dc.bind_cpus()
        if bound:
            cpu_limits.check_bind_cpus(dc.cpu_threads_bind, bound, allowed)

    def _check_kv_transfer(self) -> None:
        """``kv_transfer_config`` as a KVTransferConfig, refused with the settings the
        connector does not handle yet (named)."""
        kt = self.kv_transfer_config = KVTransferConfig.from_value(self.kv_transfer_config)
        if kt is None:
            return
        pc, sc = self.parallel_config, self.scheduler_config
        for name in ("pipeline_parallel_size", "context_parallel_size"):
            if getattr(pc, name) > 1:
                raise ValueError(f"kv_transfer_config with {name}={getattr(pc, name)} is not "
                                 "available (each rank would hold part of a block's K/V)")
        spec = self.speculative_config
        if spec is not None and spec.method != "ngram":  # ngram drafts from tokens alone
            raise ValueError(f"kv_transfer_config with speculative_config method="
                             f"{spec.method!r} is not available: the connector moves the "
                             "target model's KV, not the draft's, so the loaded prompt "
                             "blocks would have none (method 'ngram' is available)")
        refused = [("async_scheduling", bool(sc.async_scheduling)),
                   ("preemption_mode='swap'", sc.preemption_mode == "swap")]
        for name, given in refused:
            if given:
                raise ValueError(f"kv_transfer_config with {name} is not available (the "
                                 "connector loads and saves a step's blocks around its "
                                 "forward pass, in lock-step)")

    def _why_not_uni(self) -> str:
        """Why this engine's executor is not ``uni``, the second half of an error message:
        the parallel sizes above 1 when there are several ranks, else the backend chosen by
        name (distributed_executor_backend mp or ray on one rank)."""
        pc = self.parallel_config
        backend = pc.executor_backend
        sizes = [f"{name}={value}" for name, value in
                 (("tensor_parallel_size", pc.tensor_parallel_size),
                  ("pipeline_parallel_size", pc.pipeline_parallel_size),
                  ("context_parallel_size", pc.context_parallel_size)) if value > 1]
        if sizes:
            return (f"it is not available with the {backend} executor of {pc.world_size} "
                    f"ranks ({', '.join(sizes)}) yet")
        return (f"--distributed-executor-backend {backend} runs the one rank outside the "
                "engine's process: leave it out (or give uni) for async scheduling")

    def find_logits_processor_plugins(self, task: str) -> None:
        """Look for the installed logits processor plugins once, when the engine's task is
        known (the engine core calls it before any worker starts, so the workers get the list
        with the config; an API process whose config has none yet calls it too). Only a
        generating engine loads them: for a pooling task (``task`` other than
        ``"generate"``) and with speculative decoding they are not loaded, not even
        imported, so a broken one does not stop the start (vLLM v1 skips them in both
        cases); with speculative decoding a warning names them.

        Args:
            task: the resolved task (generate | embed | score | classify | token_classify).

        Raises:
            ValueError: for a plugin that does not import (``plugin_logits_processors``),
                on a generating engine without speculative decoding.
        """
        mc = self.model_config
        if mc.logits_processor_plugins is not None:
            return
        if task != "generate":  # pooling samples nothing
            mc.logits_processor_plugins = []
            return
        if self.speculative_config is not None:
            named = dict.fromkeys(entry.value for entry in
                                  importlib.metadata.entry_points(group=LOGITS_PROCESSORS_GROUP))
            if named:
                logger.warning("logits processor plugins %s (entry point group %s) are not "
                               "loaded: speculative decoding runs no custom logits processor",
                               ", ".join(named), LOGITS_PROCESSORS_GROUP)
            mc.logits_processor_plugins = []
            return
        mc.logits_processor_plugins = plugin_logits_processors()

    def _check_speculative(self) -> None:
        spec = self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        if spec is None:
            return
        if self.model_config.enable_prompt_embeds:
            raise ValueError(f"speculative decoding (method={spec.method!r}) with "
                             "enable_prompt_embeds is not available: the proposer needs the "
                             "prompt's token ids, which a prompt given as embeddings has not")
        if self.model_config.logits_processors:
            raise ValueError(f"speculative decoding (method={spec.method!r}) with custom "
                             "logits processors (--logits-processors) is not available: "
                             "verification samples several positions per request, which "
                             "processors' one-row-per-request state cannot describe (as in "
                             "vLLM v1); drop one of them")
        pc = self.parallel_config
        for name in ("pipeline_parallel_size", "context_parallel_size"):
            if getattr(pc, name) > 1:
                raise ValueError(f"speculative decoding with {name} > 1 is not available (the "
                                 "draft tokens would have to reach every rank's sampler)")
        if spec.method == "deepseek_mtp" and not spec.model:  # the target's own MTP layers
            spec.model = self.model_config.model
        if spec.method in HEAD_METHODS:
            self._check_eagle()
        if self.scheduler_config.async_scheduling:
            raise ValueError("speculative decoding with async_scheduling is not available (a "
                             "verification step's token counts are known only after it)")

    def _check_eagle(self) -> None:
        """An EAGLE / MTP head (kvflow/spec_decode/eagle.py) runs without adapters: it reads
        the target's hidden states and its unadapted embedding and LM head. With tensor
        parallelism every rank runs the whole head (kvflow/spec_decode/eagle.py)."""
        method = self.speculative_config.method
        if self.scheduler_config.preemption_mode == "swap":
            raise ValueError(f"speculative_config method={method!r} with preemption_mode swap "
                             "is not available (a swapped-in request would have no target "
                             "hidden states to feed the head); use preemption_mode recompute")
        if self.lora_config.enable_lora:
            raise ValueError(f"speculative_config method={method!r} with enable_lora is not "
                             "available (the head was trained on the base model's hidden "
                             "states); drop one of them")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (``LLM(model=..., block_size=...)``; a field's
        ``aliases``, e.g. vLLM's ``scheduling_policy`` for ``policy``, name it too);
        ``speculative_config`` takes a dict, a JSON string or a SpeculativeConfig,
        ``kv_events_config`` a dict, a JSON string or a KVEventsConfig,
        ``kv_transfer_config`` a dict, a JSON string or a KVTransferConfig; vLLM's
        ``spec_method`` / ``spec_model`` / ``spec_tokens`` set ``speculative_config``'s
        method / model / num_speculative_tokens (``merge_spec_shorthands``).

        Raises:
            ValueError: on an unknown keyword, naming the closest valid one (if one is close)
                and ``kvflow serve --help``, which lists them as flags, a field given under
                two names (a speculative key both ways too), or a bad value.
        """
        speculative = merge_spec_shorthands(
            kwargs.pop("speculative_config", None),
            {name: kwargs.pop(name, None) for _, name, _ in SPEC_SHORTHANDS})
        kv_events = kwargs.pop("kv_events_config", None)
        kv_transfer = kwargs.pop("kv_transfer_config", None)
        parts: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        owner = {f.name: sec for sec, c in _SECTIONS.items() for f in fields(c)}
        alias = {a.lstrip("-").replace("-", "_"): f.name for c in _SECTIONS.values()
                 for f in fields(c) for a in f.metadata.get("aliases", ())}
        for key, value in kwargs.items():
            if key in alias:
                if alias[key] in kwargs:
                    raise ValueError(f"{key} and {alias[key]} name the same option: give one")
                key = alias[key]
            if key not in owner:  # kvflow's own fields (cli=False) are never suggested
                user = [f.name for c in _SECTIONS.values() for f in fields(c)
                        if f.metadata.get("cli", True)]
                raise ValueError(_unknown_option(key, [*user, *alias, *_JSON_SECTIONS,
                                                       *_SPEC_KEYWORDS]))
            parts[owner[key]][key] = value
        return cls(**{sec: _SECTIONS[sec](**vals) for sec, vals in parts.items()},
                   speculative_config=speculative, kv_events_config=kv_events,
                   kv_transfer_config=kv_transfer)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one ``--flag`` per config field (booleans get ``--no-`` forms), and
        ``--speculative-config`` and ``--kv-events-config`` (JSON objects of
        SpeculativeConfig's and KVEventsConfig's fields)."""
        for sec_cls in _SECTIONS.values():
            group = parser.add_argument_group(sec_cls.__name__)
            for f in fields(sec_cls):
                add_field_arg(group, f)
        keys = ", ".join(
            f"{f.name} ({_SPEC_METHOD_DEFAULT if f.name == 'method' else f.default})"
            for f in fields(SpeculativeConfig))
        spec = parser.add_argument_group("SpeculativeConfig")
        spec.add_argument(
            "--speculative-config", type=str, default=None,
            help="speculative decoding as a JSON object, e.g. '{\"method\": \"ngram\", "
                 "\"num_speculative_tokens\": 4}' or '{\"method\": \"draft_model\", "
                 "\"model\": \"NAME\", \"num_speculative_tokens\": 4}' (method \"eagle\" / "
                 "\"eagle3\": \"model\" an EAGLE-1 / EAGLE-3 head); keys (defaults): "
                 f"{keys} (default: off)")
        for flag, _, key in SPEC_SHORTHANDS:  # vLLM's shorthands of three keys
            spec.add_argument(flag, type=int if key == "num_speculative_tokens" else str,
                              default=None, help=f"--speculative-config's {key!r} (vLLM's "
                              "shorthand; refused when that JSON sets it too; default: "
                              "unset)")
        keys = ", ".join(f"{f.name} ({f.default})" for f in fields(KVEventsConfig))
        parser.add_argument_group("KVEventsConfig").add_argument(
            "--kv-events-config", type=str, default=None,
            help="KV cache events for KV-aware routers as a JSON object, e.g. "
                 "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\"}' "
                 "(vLLM's keys; msgpack KVEventBatch on a ZeroMQ PUB socket); keys "
                 f"(defaults): {keys} (default: off)")
        parser.add_argument_group("KVTransferConfig").add_argument(
            "--kv-transfer-config", type=str, default=None,
            help="disaggregated prefill / KV transfer as a JSON object (vLLM's keys), e.g. "
                 "'{\"kv_connector\": \"SharedStorageConnector\", \"kv_role\": \"kv_both\", "
                 "\"kv_connector_extra_config\": {\"shared_storage_path\": \"/tmp/kv\"}}'; "
                 "kv_role: kv_producer (saves prompt KV), kv_consumer (loads it), kv_both "
                 "(default: off)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        names = {f.name for c in _SECTIONS.values() for f in fields(c)}
        names.update(_JSON_SECTIONS, _SPEC_KEYWORDS)
        return cls.from_kwargs(**{k: v for k, v in vars(args).items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _unknown_option(key: str, names: list[str]) -> str:
    """The refusal of ``LLM(key=...)`` (``from_kwargs``): the closest of ``names`` (the valid
    keywords) if one is close, and where the whole list is, short of printing ~150 names; for
    a reasoning option, where it goes instead (``AsyncLLM``'s keyword)."""
    if key in REASONING_OPTIONS:
        return (f"{key} is not an engine option: give it to LLM(..., {key}=...) or "
                f"AsyncLLM(config, {key}=...)")
    return (f"unknown engine option {key!r}{did_you_mean(key, names)}; `kvflow serve --help` "
            "lists them as the flags of its groups ModelConfig to KVTransferConfig "
            "(--max-model-len is max_model_len)")
