"""Tool-call and reasoning parsers for /v1/chat/completions and /v1/responses.

Every parser is a pure function of the text generated so far: ``parse(text, final)`` returns
the content, and the tool calls (name, arguments JSON text). Streaming re-parses the growing
text and sends only what is new (``streaming.StreamingToolState``); a parser's content and
each call's arguments only grow as the text does, so the streamed pieces always join to
exactly the non-streamed reply. The JSON-based parsers scan spans of the model's JSON
(``json_spans``), not a JSON grammar: under ``tool_choice`` required or named the grammar
backend does the constraining. Streamed or not, a reply carries the same calls.

One module per ``--tool-call-parser`` (vLLM's names), each documenting its format:
``hermes``, ``llama3_json`` (and ``llama4_json``), ``mistral``, ``pythonic`` (and
``llama4_pythonic``), ``qwen3_coder``, ``deepseek_v3``, ``deepseek_v31``, ``kimi_k2``
(the last three share ``marked_blocks``), ``granite``, ``internlm`` (and ``internlm2``), ``jamba``,
``xlam``, ``glm45``, ``qwen3_xml`` (``qwen3_coder``'s format), ``minimax``, ``phi4_mini_json``,
``seed_oss``, ``hunyuan_a13b``, ``step3``, ``granite-20b-fc``; ``forced`` reads
grammar-forced output (``named``, ``required``); ``reasoning`` holds the
``--reasoning-parser`` choices; ``base`` the shared types.
"""

from __future__ import annotations

from typing import Any

from kvflow.entrypoints.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    new_tool_call_id,
)
from kvflow.entrypoints.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from kvflow.entrypoints.tool_parsers.deepseek_v31 import DeepSeekV31ToolParser
from kvflow.entrypoints.tool_parsers.forced import NamedToolParser, RequiredToolParser
from kvflow.entrypoints.tool_parsers.glm45 import Glm45ToolParser
from kvflow.entrypoints.tool_parsers.granite import GraniteToolParser
from kvflow.entrypoints.tool_parsers.granite_20b_fc import Granite20bFCToolParser
from kvflow.entrypoints.tool_parsers.hermes import HermesToolParser
from kvflow.entrypoints.tool_parsers.hunyuan_a13b import HunyuanA13BToolParser
from kvflow.entrypoints.tool_parsers.internlm import InternLM2ToolParser, InternLMToolParser
from kvflow.entrypoints.tool_parsers.jamba import JambaToolParser
from kvflow.entrypoints.tool_parsers.kimi_k2 import KimiK2ToolParser
from kvflow.entrypoints.tool_parsers.llama3_json import Llama3JsonToolParser, Llama4JsonToolParser
from kvflow.entrypoints.tool_parsers.minimax import MiniMaxToolParser
from kvflow.entrypoints.tool_parsers.mistral import MistralToolParser
from kvflow.entrypoints.tool_parsers.phi4_mini import Phi4MiniJsonToolParser
from kvflow.entrypoints.tool_parsers.pythonic import (
    Llama4PythonicToolParser,
    PythonicToolParser,
)
from kvflow.entrypoints.tool_parsers.qwen3_coder import Qwen3CoderToolParser, Qwen3XMLToolParser
from kvflow.entrypoints.tool_parsers.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    GraniteReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    ThinkReasoningParser,
    make_reasoning_parser,
)
from kvflow.entrypoints.tool_parsers.seed_oss import SeedOssToolParser
from kvflow.entrypoints.tool_parsers.step3 import Step3ToolParser
from kvflow.entrypoints.tool_parsers.streaming import StreamDelta, StreamingToolState
from kvflow.entrypoints.tool_parsers.xlam import XLAMToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesToolParser, Llama3JsonToolParser, Llama4JsonToolParser, MistralToolParser,
    PythonicToolParser, Llama4PythonicToolParser, Qwen3CoderToolParser, DeepSeekV3ToolParser,
    DeepSeekV31ToolParser, KimiK2ToolParser, GraniteToolParser, InternLMToolParser,
    InternLM2ToolParser, JambaToolParser, XLAMToolParser, Glm45ToolParser, Qwen3XMLToolParser,
    MiniMaxToolParser, Phi4MiniJsonToolParser, SeedOssToolParser, HunyuanA13BToolParser,
    Step3ToolParser, Granite20bFCToolParser)}


def make_tool_parser(name: str, tools: list[dict[str, Any]] | None = None) -> ToolParser:
    """The ``--tool-call-parser`` named ``name`` for a request offering ``tools`` (OpenAI's
    shape; None: unknown, any function name is read).

    Raises:
        ValueError: for an unknown parser name, listing the choices.
    """
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of "
                         f"{sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name](tools)


__all__ = [
    "REASONING_PARSERS", "TOOL_PARSERS", "DeepSeekR1ReasoningParser", "DeepSeekV3ToolParser",
    "DeepSeekV31ToolParser", "Glm45ToolParser", "Granite20bFCToolParser",
    "GraniteReasoningParser", "GraniteToolParser", "HermesToolParser", "HunyuanA13BToolParser",
    "InternLM2ToolParser", "InternLMToolParser", "JambaToolParser", "KimiK2ToolParser",
    "Llama3JsonToolParser", "Llama4JsonToolParser", "Llama4PythonicToolParser",
    "MiniMaxToolParser", "MistralToolParser", "NamedToolParser", "ParsedCall", "ParsedOutput",
    "Phi4MiniJsonToolParser", "PythonicToolParser", "Qwen3CoderToolParser",
    "Qwen3ReasoningParser", "Qwen3XMLToolParser", "ReasoningParser", "RequiredToolParser",
    "SeedOssToolParser", "Step3ToolParser", "StreamDelta", "StreamingToolState",
    "ThinkReasoningParser", "ToolParser", "XLAMToolParser",
    "make_reasoning_parser", "make_tool_parser", "new_tool_call_id",
]
