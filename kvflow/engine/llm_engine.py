"""LLMEngine: EngineCore plus input and output processing, all in the caller's process.

The offline ``LLM`` (kvflow/offline/llm.py) drives it; the server uses ``AsyncLLM`` instead, which runs
the core in a process of its own. With ``data_parallel_size`` N > 1 the core is a
:class:`~kvflow.engine.dp_client.DPCoreClient`: N engine-core processes, each prompt sent to
one of them by the data-parallel load balancer.
"""

from __future__ import annotations

import itertools
from typing import Any

from kvflow.config import EngineConfig
from kvflow.core.engine_core import EngineCore
from kvflow.engine.dp_client import DPCoreClient
from kvflow.engine.output_processor import OutputProcessor
from kvflow.engine.start_method import core_start_method
from kvflow.engine.streams import request_error
from kvflow.inputs.processor import InputProcessor
from kvflow.inputs.prompts import ProcessedPrompt, PromptType
from kvflow.inputs.truncation import SAMPLING_FIELD, truncation_length
from kvflow.logits_process import load_logits_processors
from kvflow.lora.request import LoRARequest
from kvflow.models.generation_config import load_eos_token_ids, load_sampling_defaults
from kvflow.models.loader import load_hf_config, load_tokenizer, resolve_eos_token_id
from kvflow.models.model_resolver import ModelSource, resolve_model
from kvflow.models.tokenizer_source import tokenizer_source
from kvflow.multimodal import MultiModalProcessor, make_mm_processor
from kvflow.outputs import EmbeddingRequestOutput, RequestOutput
from kvflow.pooling_params import PoolingParams
from kvflow.quant import get_quant_config
from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode.draft_tokenizer import check_draft_tokenizer


class LLMEngine:
    """EngineCore plus the input and output processing around it (in one process), or, with
    ``data_parallel_size`` N > 1, N engine-core processes behind a ``DPCoreClient``.

    The constructor reads the model folder's config.json, tokenizer, generation config and
    image processor before the core loads any weight, so a broken one fails in seconds.

    Raises:
        ValueError: from the constructor for a bad config, tokenizer or model, or a bad
            ``KVFLOW_WORKER_MULTIPROC_METHOD`` (also without data parallelism); from
            ``add_request`` for a bad prompt or parameters (other requests keep running).
        RuntimeError: with data parallelism, from the constructor if a replica fails to start
            and from ``step`` if one dies (naming it).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        core_start_method(fresh_process=False)  # a bad variable is refused, replicas or not
        mc = config.model_config
        source = resolve_model(mc.model, mc.download_dir, mc.revision, mc.hf_token)  # a Hub download happens here
        hf_config = self._init_model_files(source)
        # the EOS ids as the front end stops on them: a data-parallel parent reads config.json
        dp = config.parallel_config.data_parallel_size > 1
        eos_ids = load_eos_token_ids(source, None if dp else hf_config, hf_config.vocab_size)
        mm_processor = _mm_processor(source, hf_config, self.tokenizer, config)
        self.core: EngineCore | DPCoreClient = DPCoreClient(config) if dp \
            else EngineCore(config, source)
        self.core.tokenizer = self.tokenizer  # grammar compiles reuse it (in-process core)
        self.processor = self._init_input_processor(dp, mm_processor, eos_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.lost: dict[str, str] = {}  # the requests the last step took with it (it failed)

    def _init_model_files(self, source: ModelSource) -> Any:
        """Read the model folder's small files, so a bad one fails in seconds, not after the
        weight load: config.json before the tokenizer (transformers may read it to pick the
        tokenizer class, and would report a broken one as a tokenizer failure), then
        ``--quantization`` against the checkpoint's metadata (the workers build it again), the
        draft model's tokenizer (before the draft's weights) and the sampling defaults. Sets
        ``tokenizer`` and ``sampling_defaults``; returns the HF config.

        Raises:
            ValueError: for a bad config, quantization, tokenizer or generation config.
        """
        mc = self.config.model_config
        hf_config = load_hf_config(source, hf_overrides=mc.hf_overrides,
                                   trust_remote_code=mc.trust_remote_code)
        get_quant_config(mc.quantization, hf_config, source.kind, mc.quantization_group_size)
        self.tokenizer = None if mc.skip_tokenizer_init else \
            load_tokenizer(source, tokenizer_source(mc), mc.download_dir, mc.tokenizer_options,
                           mc.hf_token)
        check_draft_tokenizer(self.config, source, self.tokenizer)
        self.sampling_defaults = load_sampling_defaults(source, mc.generation_config,
                                                       mc.override_generation_config)
        return hf_config

    def _init_input_processor(self, dp: bool, mm_processor: MultiModalProcessor | None,
                              eos_ids: list[int]) -> InputProcessor:
        """The input processor, sized by the started core (``dp``: a ``DPCoreClient``, which
        reports its replicas' sizes, else an in-process ``EngineCore``)."""
        mc = self.config.model_config
        if dp:
            ready = self.core.ready
            max_model_len, eos_source = self.core.max_model_len, ready
            note, vocab_size = ready.max_model_len_note, ready.vocab_size
            pooler, hidden_size = ready.pooler, ready.hidden_size
        else:
            eos_source = self.core.hf_config
            max_model_len, vocab_size = self.core.max_model_len, self.core.hf_config.vocab_size
            note = self.core.max_model_len_note
            pooler, hidden_size = self.core.pooler_config, self.core.hf_config.hidden_size
        eos = resolve_eos_token_id(self.tokenizer, eos_source)
        if pooler is None:  # a data-parallel parent's config has not looked for plugins yet
            self.config.find_logits_processor_plugins("generate")
        return InputProcessor(self.tokenizer, max_model_len, vocab_size, eos,
                              mm_processor, eos_ids,
                              pooler, hidden_size, max_model_len_note=note,
                              enable_prompt_embeds=mc.enable_prompt_embeds,
                              logits_processors=() if pooler else
                              load_logits_processors(mc.custom_logits_processors()))

    def add_request(self, prompt: PromptType | ProcessedPrompt, params: SamplingParams,
                    request_id: str | None = None, priority: int = 0,
                    client_id: str = "",
                    lora_request: LoRARequest | None = None) -> str:
        """Validate and queue one prompt (raw, or already ``processor.process``-ed); returns
        its request id. Fields ``params`` was not given take the model's sampling defaults
        (``sampling_defaults``, from its generation_config.json unless
        ``generation_config="none"``). ``client_id`` names the sender for the fair policy;
        ``lora_request``: the adapter to run with (loaded first if it is not yet).

        Raises:
            ValueError: for a bad prompt, image, parameters or LoRA adapter, or a nonzero
                ``priority`` under a policy that does not read it (nothing is queued).
        """
        self.config.scheduler_config.check_priority(priority)
        request_id = request_id if request_id is not None else str(next(self._ids))
        params = params.with_defaults(self.sampling_defaults)
        if not isinstance(prompt, ProcessedPrompt):  # prompt_embeds rows cut before their check
            prompt = self.processor.process(prompt, keep_last=truncation_length(
                params.truncate_prompt_tokens, self.processor.max_model_len, SAMPLING_FIELD,
                generation=True))
        if lora_request is not None:
            self.core.add_lora(lora_request)
        requests = self.processor.make_requests(request_id, prompt.token_ids, params,
                                                priority=priority,
                                                mm_features=prompt.mm_features,
                                                client_id=client_id,
                                                lora_request=lora_request,
                                                cache_salt=prompt.cache_salt,
                                                prompt_embeds=prompt.prompt_embeds)
        self.output_processor.add_request(prompt.text, requests)
        try:
            if isinstance(self.core, DPCoreClient):  # the samples go to one replica together
                self.core.add_requests(requests)
            else:
                for r in requests:
                    self.core.add_request(r)
        except BaseException:  # the core refused one (e.g. the wrong task): forget them all
            self.abort_request(request_id)
            raise
        return request_id

    def add_pooling_request(self, prompt: PromptType, params: PoolingParams | None = None,
                            request_id: str | None = None, client_id: str = "") -> str:
        """Validate and queue one embedding request; returns its id. ``client_id`` names the
        sender for the fair policy.

        Raises:
            ValueError: on a generation model, for a bad prompt or ``dimensions``.
        """
        request_id = request_id if request_id is not None else str(next(self._ids))
        text, token_ids = self.processor.pooling_prompt(prompt, (params or PoolingParams()).task)
        request = self.processor.make_pooling_request(request_id, token_ids, params,
                                                      client_id=client_id)
        self.output_processor.add_request(text, [request])
        try:
            if isinstance(self.core, DPCoreClient):
                self.core.add_requests([request])
            else:
                self.core.add_request(request)
        except BaseException:  # refused by the core: nothing of it may stay unfinished
            self.abort_request(request_id)
            raise
        return request_id

    def _forget_lost_requests(self, error: BaseException) -> dict[str, str]:
        """After the core's step raised: forget (and abort the other samples of) each request
        the core no longer holds; returns their ids -> ``"<ErrorType>: <error>"``."""
        open_samples = self.output_processor.open_samples()
        lost = {open_samples[sid] for sid in _lost_samples(self.core, open_samples)}
        why = f"{type(error).__name__}: {error}".rstrip(": ")
        for parent in lost:
            self.abort_request(parent)
        return dict.fromkeys(sorted(lost), why)

    def local_core(self, what: str) -> EngineCore:
        """The in-process EngineCore, for calls a data-parallel client does not relay.

        Raises:
            ValueError: with data_parallel_size > 1 (``what`` names the call).
        """
        if self.config.parallel_config.data_parallel_size > 1:
            raise ValueError(f"{what} is not available offline with data_parallel_size > 1 "
                             "(the API server's /sleep and /wake_up reach every replica)")
        return self.core

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (of each data-parallel replica): see
        ``EngineCore.reset_prefix_cache``. Returns False, changing nothing, while requests
        are unfinished (with data parallelism: on any replica).

        Raises:
            RuntimeError: with data parallelism, if a replica failed or exited.
        """
        return self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine's worker processes, if any (idempotent)."""
        self.core.shutdown()

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """One engine step; returns the outputs that changed (finished or not).

        Raises:
            RequestRefused: (a ValueError) when the core could not run a request (an output
                with ``error``: its grammar did not compile within
                ``structured_output_compile_timeout``, or failed to; or its
                ``allowed_token_ids`` miss every token the grammar allows first), naming it by
                ``request_id``; the step's other outputs are folded in first (and set as
                the error's ``outputs``; its ``refused`` maps each request refused in the
                step to why), the refused requests forgotten and their other samples
                aborted (the other requests keep running; a caller that does not re-raise
                may step on).
            Exception: whatever the core's step raised (an internal error in the model
                runner, a KeyboardInterrupt, ...), re-raised after every request the failed
                step took with it (the core aborted what it scheduled) is forgotten here
                too, so that ``has_unfinished_requests`` does not wait for it for ever;
                ``lost`` maps those request ids to the error's text.
        """
        self.lost = {}
        try:
            core_outputs = self.core.step()
        except BaseException as e:  # KeyboardInterrupt too: the caller may step on
            self.lost = self._forget_lost_requests(e)
            raise
        refused = [(parent, eco) for eco in core_outputs if eco.error is not None
                   and (parent := self.output_processor.parent_of(eco.request_id))]
        for parent, _ in refused:  # process() then skips the refused samples' outputs
            self.abort_request(parent)
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self.core.abort_requests(stopped, stopped=True)
        if refused:
            parent, eco = refused[0]
            refused = [(p, e.error) for p, e in refused]
            error = request_error(eco.error, parent, field=eco.error_field,
                                  internal=eco.internal_error)
            error.outputs = outputs  # what the step gave the other requests
            error.refused = dict(refused)  # every request refused in the step: why
            raise error
        return outputs


def _lost_samples(core: EngineCore | DPCoreClient, open_samples: dict[str, str]) -> set[str]:
    """The samples of ``open_samples`` (sample id -> request id) that ``core`` no longer
    holds after a failed step: those the in-process core's scheduler forgot (the failed step
    aborted them), or, with data parallelism, those of a replica that died."""
    if isinstance(core, DPCoreClient):
        return {sid for sid in open_samples if not core.holds(sid)}
    return {sid for sid in open_samples if sid not in core.scheduler.requests}


def _mm_processor(source: ModelSource, hf_config: Any, tokenizer: Any,
                  config: EngineConfig) -> MultiModalProcessor | None:
    """The image processor of a vision-language model (None for a text-only one, and for a
    GGUF file: kvflow loads no vision-language GGUF).

    Raises:
        ValueError: for a model folder without a loadable image processor.
    """
    if source.kind == "gguf":
        return None
    return make_mm_processor(source, hf_config, tokenizer, config.multimodal_config)
