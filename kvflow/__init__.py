"""kvflow: a paged-KV LLM inference and serving engine."""

from kvflow.llm import LLM, LLMEngine
from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput",
           "__version__"]
