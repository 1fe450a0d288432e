"""The layering rule, checked on the source: no module imports one that runs above it.

Layers, top to bottom (docs/architecture.md, "Where things live"): entrypoints and bench ->
the offline API (offline/) -> engine (processes, input/output processing, metrics) -> core
(scheduler, KV-cache manager, structured output) -> executor -> worker -> models ->
layers/attention -> kernels and distributed (process groups, collectives) -> platforms ->
foundation (config and the pure-data modules that cross boundaries). A module may import its
own layer and the ones below it. Imports inside ``if TYPE_CHECKING:`` are annotations only and
do not count; function-local imports do.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvflow"

# Longest matching prefix wins. Rank: higher runs above lower.
LAYERS: dict[str, int] = {
    "kvflow.chat": 8,  # the package: its __init__, a module not listed
    "kvflow.metrics": 8,  # the package: its __init__, a module not listed
    "kvflow.offline": 8,  # the package: its __init__, a module not listed
    "kvflow.runtime": 0,  # the package: its __init__, a module not listed
    "kvflow.sampling": 0,  # the package: its __init__, a module not listed
    "kvflow.utils": 0,  # the package: its __init__, a module not listed
    "kvflow.entrypoints": 10, "kvflow.bench": 10, "kvflow.__main__": 10,
    "kvflow.entrypoints.completion_embeds": 10,  # /v1/completions' prompt_embeds
    "kvflow.entrypoints.preload_checks": 10,  # serve's --host/--port, --uds, --lora-modules
    "kvflow.entrypoints.completion_prompts": 10,  # /v1/completions' prompt field read
    "kvflow.entrypoints.responses_keeper": 10,  # /v1/responses' stored replies and their routes
    "kvflow.entrypoints.completion_echo": 10,  # /v1/completions' echo with max_tokens 0
    "kvflow.offline.llm": 9, "kvflow.offline.ops": 9,
    "kvflow.engine": 8, "kvflow.inputs.processor": 8, "kvflow.engine.output_processor": 8,
    "kvflow.engine.front_end": 8,  # AsyncLLM's tokenizer, defaults, InputProcessor
    "kvflow.inputs.pooling": 8,  # InputProcessor's pooling half (its base class)
    "kvflow.inputs.sampling_checks": 8,  # InputProcessor's SamplingParams checks against the model
    "kvflow.inputs.prompts": 8,  # the prompt forms, a dict prompt's parsing, its token ids
    "kvflow.inputs.media": 8,  # InputProcessor's multimodal half (images, videos, kwargs)
    "kvflow.inputs.samples": 8,  # InputProcessor's per-sample SamplingParams (n fan-out)
    "kvflow.inputs.tokenization": 8,  # LLM's tokenization_kwargs for a prompt's tokenizer call
    "kvflow.engine.detokenizer": 8, "kvflow.engine.detokenizer_tokens": 8, "kvflow.engine.detokenizer_stops": 8, "kvflow.engine.logprob_tokens": 8, "kvflow.metrics.server": 8, "kvflow.chat.template": 8,
    "kvflow.metrics.buckets": 8, "kvflow.metrics.request_stats": 8,  # /metrics' boundaries, requests
    "kvflow.metrics.prompt_sources": 8,  # /metrics' prompt tokens by source (vLLM's)
    "kvflow.metrics.cache_config": 8,  # /metrics' cache_config_info (vLLM's)
    "kvflow.metrics.spec_decode": 8,  # /metrics' speculative decoding series (vLLM's)
    "kvflow.metrics.lora": 8,  # /metrics' lora_requests_info (vLLM's)
    "kvflow.beam_search": 8,  # beam search above the engine (LLM.beam_search, the server)
    "kvflow.offline.arguments": 8,  # LLM's per-call argument checks (prompts, one SamplingParams each)
    "kvflow.offline.pooling": 8,  # LLM's pooling half (embed, encode, classify, score), mixed into LLM
    "kvflow.offline.score": 8,  # LLM.score (cross-encoder pairs, embedding cosine), mixed into LLM
    "kvflow.inputs.reasoning": 8,  # LLM's reasoning_parser: markers on budgeted / constrained params
    "kvflow.offline.chat": 8,  # LLM.chat (and enqueue_chat's rendering), mixed into LLM
    "kvflow.offline.queue": 8,  # LLM.enqueue / wait_for_completion and the steps every call runs
    "kvflow.offline.stats": 8,  # LLM.get_metrics's metrics, fed by the offline steps
    "kvflow.metrics_reader": 8,  # a Prometheus registry read as vLLM's metrics reader reads it
    "kvflow.inputs.score": 8,  # text pairs -> cross-encoder prompts (LLM.score, /v1/score)
    "kvflow.chat_template_source": 8, "kvflow.chat.messages": 8, "kvflow.chat.tool_calls": 8,
    "kvflow.chat.tools_text": 8,  # tools as text for a template without them (LLM.chat, server)
    "kvflow.multimodal": 8, "kvflow.multimodal.processor_files": 8,  # its processor configs read
    "kvflow.core": 7, "kvflow.structured": 7, "kvflow.spec_decode": 7,
    "kvflow.core.sched_stops": 7,  # the stop rule on one request after a step (sched_update)
    "kvflow.core.kv_prefix_cache": 7,  # KVCacheManager's prefix-cache half (its base class)
    "kvflow.core.sched_arrivals": 7,  # the scheduler's admission verdict, TTFT forecast
    "kvflow.core.kv_connector_startup": 7,  # the KV connector's scheduler half at start-up
    "kvflow.structured.xgrammar_convert": 7,  # a constraint as xgrammar's grammar
    "kvflow.structured.xgrammar_validate": 7,  # a constraint checked without a tokenizer
    "kvflow.structured.xgrammar_errors": 7,  # xgrammar's errors in the user's terms
    "kvflow.structured.count_budget": 7,  # the compile budget on overlapping class counts
    "kvflow.structured.ebnf_reading": 7,  # scanning xgrammar's printed EBNF
    "kvflow.structured.regex_empty": 7,  # whether a regex matches no string
    "kvflow.executor": 6,
    "kvflow.worker": 5,
    # speculative decoding's runner side: the draft model and verification run in the worker,
    # the rejection sampler is sampling math beside layers/sampler.py
    "kvflow.spec_decode.draft_model": 5, "kvflow.spec_decode.verification": 5,
    "kvflow.spec_decode.draft_proposal": 5,  # a draft step's proposal (worker level)
    "kvflow.spec_decode.draft_choice": 5,  # its draft tokens chosen from the logits
    "kvflow.spec_decode.eagle": 5,  # the EAGLE head proposing in the runner (worker side)
    "kvflow.spec_decode.feature_stash": 5, "kvflow.spec_decode.head_loading": 5,  # its parts
    "kvflow.spec_decode.layer_taps": 5,  # EAGLE-3's hooks on the target's layers
    "kvflow.spec_decode.draft_timing": 5,  # the draft timed at start-up (worker side)
    "kvflow.spec_decode.rejection_sampler": 3,
    "kvflow.spec_decode.draft_threads": 2,  # the draft's CPU thread count (torch only)
    "kvflow.spec_decode.draft_vocab": 3,  # the draft's LM head cut to frequent tokens (a layer)
    "kvflow.models": 4, "kvflow.lora": 4,
    "kvflow.models.gguf_rope_scaling": 4,  # a GGUF file's rope_scaling (gguf_config)
    "kvflow.models.load_checks": 4,  # load_model's refusals (checkpoint vs config, weights)
    "kvflow.layers": 3, "kvflow.attention": 3, "kvflow.quant": 3,
    "kvflow.kernels": 2, "kvflow.distributed": 2,
    "kvflow.kernels.gemm_timing_cache": 2,  # the GEMM timings' cache file and key
    "kvflow.distributed.kv_transfer.storage_keys": 2,  # SharedStorageConnector's keys
    "kvflow.distributed.kv_transfer.storage_layouts": 2,  # its producers' layout records
    "kvflow.distributed.kv_transfer.storage_paths": 2,  # its block files' paths, its folder
    "kvflow.distributed.kv_transfer.storage_writes": 2,  # its atomic writes, orphan sweep
    "kvflow.distributed.kv_transfer.storage_worker": 2,  # its worker half (block loads, saves)
    "kvflow.platforms": 1,
    # foundation: configuration and pure data that crosses a boundary
    "kvflow.config": 0, "kvflow.runtime.openmp_env": 0, "kvflow.runtime.malloc_env": 0, "kvflow.runtime.gc_heap": 0,
    "kvflow.runtime.exit_threads": 0,
    "kvflow.sampling_params": 0, "kvflow.sampling.stop_limits": 0, "kvflow.request": 0,
    "kvflow.sampling.repetition_detection": 0,  # SamplingParams.repetition_detection
    "kvflow.sampling.fields": 0,  # SamplingParams' own field checks (types, ranges)
    "kvflow.outputs": 0, "kvflow.sched_output": 0, "kvflow.runner_output": 0,
    "kvflow.engine_outputs": 0, "kvflow.kv_cache_interface": 0, "kvflow.structured.params": 0,
    "kvflow.utils.text_checks": 0, "kvflow.inputs.multimodal": 0, "kvflow.lora.request": 0,
    "kvflow.thinking_budget": 0,  # thinking_token_budget: the markers (SamplingParams) and rule
    "kvflow.sampling.reasoning_markers": 0,  # a reasoning parser's / reasoning_config's markers as ids
    "kvflow.pooling_params": 0, "kvflow.utils.validation_words": 0, "kvflow.inputs.truncation": 0,
    "kvflow.inputs.embeds": 0, "kvflow.sampling.token_masks": 0,
    "kvflow.utils.int_limits": 0,  # the 32/64-bit bounds of request integers (offline and server)
    "kvflow.utils.close_names": 0,  # the closest valid name to a misspelled one (CLI, LLM, params)
    "kvflow.beam_search_params": 0,  # BeamSearchParams (also kvflow.sampling_params', vLLM's path)
    "kvflow.inputs": 0,  # vLLM's vllm.inputs: the prompt forms as TypedDicts
    "kvflow.kv_connector_meta": 0,  # a KV connector's per-step loads and saves
    # custom logits processors' interface (the config loads the classes) and the batch
    # changes they are told (runner -> processor)
    "kvflow.core.request_errors": 0,  # the request fields an error names (no imports)
    "kvflow.worker.request_failures": 0,  # a per-request fault's rule (torch, runner_output)
    "kvflow.logits_process": 0, "kvflow.batch_update": 0,
}
FACADES = {"kvflow"}  # the package root imports lazily from anywhere (kvflow.LLM etc.)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def rank(module: str) -> int | None:
    best = None
    for prefix, r in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and \
                (best is None or len(prefix) > len(best[0])):
            best = (prefix, r)
    return None if best is None else best[1]


def runtime_imports(tree: ast.AST) -> list[tuple[str, int]]:
    """(kvflow module, line) of every import outside ``if TYPE_CHECKING:`` blocks."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [f"{child.module}.{a.name}" for a in child.names]
                # ``from kvflow.kernels import cpu_build`` imports the submodule
                found.extend((n if rank(n) is not None and (ROOT.parent / (
                    n.replace(".", "/") + ".py")).exists() else child.module, child.lineno)
                    for n in names)
            visit(child)

    visit(tree)
    return [(m, line) for m, line in found if m == "kvflow" or m.startswith("kvflow.")]


SOURCES = sorted(ROOT.rglob("*.py"))


def test_every_module_has_a_layer():
    unplaced = [module_name(p) for p in SOURCES
                if module_name(p) not in FACADES and rank(module_name(p)) is None]
    assert not unplaced, f"add these modules to LAYERS: {unplaced}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_no_import_runs_back_up_the_layers(path: Path):
    module = module_name(path)
    if module in FACADES:
        return
    own = rank(module)
    upward = [f"line {line}: {target} (layer {rank(target)} > {own})"
              for target, line in runtime_imports(ast.parse(path.read_text()))
              if target not in FACADES and (rank(target) or 0) > own]
    assert not upward, f"{module} (layer {own}) imports upward: {upward}"


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule itself can fail: a kernel importing a model is caught."""
    tree = ast.parse("from kvflow.models.loader import load_model\n"
                     "def f():\n    import kvflow.core.scheduler\n")
    found = dict(runtime_imports(tree))
    assert rank("kvflow.kernels.gemm") == 2
    assert {rank(m) for m in found} == {4, 7}
    assert all(rank(m) > 2 for m in found)
