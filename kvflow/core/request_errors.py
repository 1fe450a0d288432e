"""Why the engine core cannot run one request: ``RequestError``, a ValueError that names the
part of the request at fault, so that the caller's error can name the field it came from
(the server: the OpenAI error body's ``param``).

The engine core raises it from ``EngineCore.add_request``; the core process answers it as
that request's error output (``EngineCoreOutput.error`` and ``error_field``), every other
request running on.
"""

from __future__ import annotations

# The parts of a request a RequestError may name (``RequestError.field``).
LORA_REQUEST = "lora_request"  # its LoRA adapter (the server's ``model`` field)
STRUCTURED_OUTPUTS = "structured_outputs"  # its grammar (response_format, tools, ...)
MULTI_MODAL_DATA = "multi_modal_data"  # its images or videos
PROMPT_EMBEDS = "prompt_embeds"  # its prompt embeddings
EXTRA_ARGS = "extra_args"  # its custom logits processors' arguments (the server's vllm_xargs)


class RequestError(ValueError):
    """The engine core cannot run a request, for a reason in the request itself.

    Args:
        message: why, naming what is wrong (e.g. the adapter's file and how it is corrupt).
        field: the part of the request at fault: one of this module's names
            (``LORA_REQUEST``, ...), None when the request as a whole is.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
