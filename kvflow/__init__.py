"""kvflow: a paged-KV LLM inference and serving engine."""

from kvflow.runtime.openmp_env import set_openmp_defaults

set_openmp_defaults()  # before anything imports torch (which loads the OpenMP runtime)

from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncLLM",
    "BeamSearchParams",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "LLMEngine",
    "LoRARequest",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "PromptType",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]

# vLLM's top-level names kvflow has, by the module that holds them (imported on first use)
_OUTPUTS = ("RequestOutput", "CompletionOutput", "ScoringRequestOutput", "ScoringOutput",
            "ClassificationRequestOutput", "ClassificationOutput", "PoolingRequestOutput",
            "PoolingOutput", "EmbeddingRequestOutput", "EmbeddingOutput")
_INPUTS = ("PromptType", "TextPrompt", "TokensPrompt")


def __getattr__(name: str):
    """Import the engine lazily, so ``import kvflow`` stays cheap for light users and tests."""
    if name == "LLM":
        from kvflow.offline import llm

        return llm.LLM
    if name == "LLMEngine":
        from kvflow.engine import llm_engine

        return llm_engine.LLMEngine
    if name == "AsyncLLM":
        from kvflow.engine import async_llm

        return async_llm.AsyncLLM
    if name == "BeamSearchParams":
        from kvflow.beam_search_params import BeamSearchParams

        return BeamSearchParams
    if name == "LoRARequest":
        from kvflow.lora.request import LoRARequest

        return LoRARequest
    if name in _OUTPUTS:
        from kvflow import outputs

        return getattr(outputs, name)
    if name in _INPUTS:
        from kvflow import inputs

        return getattr(inputs, name)
    raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
