"""LLMEngine: EngineCore plus input and output processing, all in the caller's process.

The offline ``LLM`` (kvflow/llm.py) drives it; the server uses ``AsyncLLM`` instead, which runs
the core in a process of its own.
"""

from __future__ import annotations

import itertools

from kvflow.config import EngineConfig
from kvflow.core.engine_core import EngineCore
from kvflow.input_processor import InputProcessor, PromptType
from kvflow.models.generation_config import load_sampling_defaults
from kvflow.models.loader import load_tokenizer, resolve_eos_token_id
from kvflow.output_processor import OutputProcessor
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams


class LLMEngine:
    """EngineCore plus the input and output processing around it (in one process).

    Raises:
        ValueError: from the constructor for a bad config or model, or ``data_parallel_size``
            above 1 (replicas run behind ``kvflow serve`` only); from ``add_request`` for a
            bad prompt or parameters (other requests keep running).
    """

    def __init__(self, config: EngineConfig) -> None:
        dp = config.parallel_config.data_parallel_size
        if dp > 1:
            raise ValueError(f"data_parallel_size={dp} needs kvflow serve (one engine-core "
                             "process per replica behind one API server); offline, run one "
                             "LLM per process on a shard of the prompts, as with vLLM")
        self.config = config
        self.core = EngineCore(config)
        mc = config.model_config
        self.tokenizer = None if mc.skip_tokenizer_init else \
            load_tokenizer(self.core.source, mc.tokenizer)
        self.core.tokenizer = self.tokenizer  # grammar compiles reuse it
        eos = resolve_eos_token_id(self.tokenizer, self.core.hf_config)
        self.processor = InputProcessor(self.tokenizer, self.core.max_model_len,
                                        self.core.hf_config.vocab_size, eos)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.sampling_defaults = load_sampling_defaults(self.core.source, mc.generation_config)
        self._ids = itertools.count()

    def add_request(self, prompt: PromptType, params: SamplingParams,
                    request_id: str | None = None, priority: int = 0) -> str:
        """Validate and queue one prompt; returns its request id. Fields ``params`` was not
        given take the model's sampling defaults (``sampling_defaults``, from its
        generation_config.json unless ``generation_config="none"``)."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        params = params.with_defaults(self.sampling_defaults)
        text, token_ids = self.processor.tokenize(prompt)
        requests = self.processor.make_requests(request_id, token_ids, params, priority=priority)
        self.output_processor.add_request(text, requests)
        for r in requests:
            self.core.add_request(r)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def shutdown(self) -> None:
        """Stop the engine's worker processes, if any (idempotent)."""
        self.core.shutdown()

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the RequestOutputs that changed (finished or not)."""
        outputs, stopped = self.output_processor.process(self.core.step())
        if stopped:
            self.core.abort_requests(stopped)
        return outputs
