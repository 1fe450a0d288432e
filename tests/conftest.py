"""Shared fixtures: tiny random-weight HF models (saved with a tiny tokenizer) for engine tests.

Every model is a real transformers model (float32, eval) with a handful of parameters
(hidden 64, 2 layers), saved with ``save_pretrained`` next to a byte-level BPE tokenizer trained
here, so ``kvflow.LLM(model=path)`` loads exactly the weights the HF reference runs. Weights are
drawn from a seeded generator with a larger spread than HF's default init (so logits are peaked
and greedy decoding has no near-ties), and norm weights and biases are randomized too, so a
weight that kvflow fails to load changes the output.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A fixed CPU thread count in every engine the tests start (servers too): with plain torch
# kernels fp32 results can differ in the last bits between thread counts, and tests compare
# runs. tests/test_cpu_contention.py turns the adaptive count on where it tests it.
os.environ.setdefault("KVFLOW_CPU_ADAPTIVE_THREADS", "0")
# The test models are tiny: intra-op threads only add contention on a shared CPU (a 10x
# slowdown measured on 2 busy cores). Override with KVFLOW_TEST_NUM_THREADS.
torch.set_num_threads(int(os.environ.get("KVFLOW_TEST_NUM_THREADS", "1")))


def _bytecode_written() -> None:
    """Let this process and every process it starts write compiled bytecode (``__pycache__``,
    ignored by git) where the environment forbids it (``PYTHONDONTWRITEBYTECODE``, set in some
    containers). Otherwise every ``kvflow serve``, engine-core and worker process that the
    suite starts compiles the ~350 kvflow modules it imports from source again: 0.3 of the
    0.6 s of CPU that importing kvflow's API server takes on the 2-core EPYC
    (docs/benchmarks.md, session 40). Only kvflow's and the tests' own folders gain ``__pycache__`` entries: pip already
    compiled the installed packages. A spawned child of this process still gets ``-B`` (its
    flags are copied from ``sys.flags``, fixed at start-up): it reads what others wrote.
    (``PYTHONPYCACHEPREFIX`` would keep the tree clean but moves every package's bytecode
    there, torch's included, to be compiled again: slower, measured.)"""
    if sys.dont_write_bytecode:
        sys.dont_write_bytecode = False
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


_bytecode_written()

EOS_TOKEN, BOS_TOKEN = "<eos>", "<bos>"
# A tiny chat template: "<user>hi\n<assistant>".
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<assistant>{% endif %}")
TOKENIZER_VOCAB = 320

# MLA and DeepSeekMoE sizes shared by the tiny DeepSeek models
_MLA_DIMS = {"num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
             "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
             "n_group": 4, "topk_group": 2}

# name -> (transformers config class name, config overrides)
TINY_MODEL_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    # one layer: an EAGLE head holding its layer nearly reproduces it (test_eagle_engine.py)
    "llama_1layer": ("LlamaConfig", {"num_hidden_layers": 1}),
    "qwen2": ("Qwen2Config", {}),  # q/k/v bias
    "qwen3": ("Qwen3Config", {"head_dim": 32}),  # q/k RMSNorm; head_dim != hidden / heads
    "llama_rope_llama3": ("LlamaConfig", {"rope_scaling": {
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "llama_rope_linear": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear",
                                                           "factor": 2.0}}),
    # linear scaling (position interpolation) from 48 positions: the context covers 96
    "llama_rope_linear48": ("LlamaConfig", {"max_position_embeddings": 48, "rope_scaling": {
        "rope_type": "linear", "factor": 2.0}}),
    # YaRN (Qwen2.5's long-context recipe): original context 64 of 256, default betas
    "qwen2_rope_yarn": ("Qwen2Config", {"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
    # YaRN with every optional field transformers reads: betas, no truncation, a small base
    # so the ramp spans several frequency pairs
    "llama_rope_yarn": ("LlamaConfig", {"max_position_embeddings": 128, "rope_theta": 500.0,
                                        "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}}),
    # dynamic NTK from 48 positions (test prompts fit; their outputs run past it), up to 192
    "llama_rope_dynamic": ("LlamaConfig", {"max_position_embeddings": 48, "rope_scaling": {
        "rope_type": "dynamic", "factor": 4.0}}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    # GeGLU (erf GELU) MLP, biases on every attention and MLP projection, one KV head of
    # head_dim 8 (not hidden / heads): config fields the parity list above leaves at defaults
    "llama_gelu_bias": ("LlamaConfig", {"hidden_act": "gelu", "attention_bias": True,
                                        "mlp_bias": True, "head_dim": 8,
                                        "num_key_value_heads": 1}),
    # one KV head for all 4 query heads: tensor parallelism replicates it
    "llama_mqa": ("LlamaConfig", {"num_key_value_heads": 1}),
    # every layer attends to the last 8 positions only (shorter than most test prompts)
    "mistral_sliding_window": ("MistralConfig", {"sliding_window": 8}),
    # Qwen2 with max_window_layers=1: layer 0 full attention, layer 1 a window of 8
    "qwen2_layer_types": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8,
                                          "max_window_layers": 1}),
    # Gemma 3: layer 0 local (window 8, RoPE base 10k), layer 1 global (base 1M); q/k norm,
    # query_pre_attn_scalar != head_dim, final logit soft-capping, tied embeddings
    "gemma3": ("Gemma3TextConfig", {
        "architectures": ["Gemma3ForCausalLM"], "head_dim": 16, "query_pre_attn_scalar": 24,
        "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
        "final_logit_softcapping": 30.0, "tie_word_embeddings": True}),
    # Gemma 3 with dynamic NTK on the global layer only (transformers 5's per-layer-type
    # rope_parameters): scaled from 48 positions up to 192, local layer plain RoPE
    "gemma3_rope_dynamic": ("Gemma3TextConfig", {
        "architectures": ["Gemma3ForCausalLM"], "head_dim": 16, "query_pre_attn_scalar": 24,
        "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 48, "tie_word_embeddings": True, "rope_parameters": {
            "full_attention": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    # Gemma 2: layer 0 local (window 8), layer 1 global, one RoPE base, attention scores
    # soft-capped at 2.0 (low, so the cap bends most scores), final logits capped at 30
    "gemma2": ("Gemma2Config", {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8,
        "attn_logit_softcapping": 2.0, "final_logit_softcapping": 30.0,
        "rope_theta": 5000.0, "tie_word_embeddings": True}),
    # Gemma 2 as a GGUF can carry it: query_pre_attn_scalar = head_dim (llama.cpp's rule)
    "gemma2_gguf": ("Gemma2Config", {
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
        "attn_logit_softcapping": 2.0, "final_logit_softcapping": 30.0,
        "rope_theta": 5000.0, "tie_word_embeddings": True}),
    # Phi-3 with LongRoPE (short factors below 64 positions) and half of each head rotated
    "phi3_longrope": ("Phi3Config", {
        "original_max_position_embeddings": 64, "partial_rotary_factor": 0.5,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 4.0],
                         "long_factor": [2.0, 3.0, 6.0, 9.0]}}),
    # Granite 3.x: embedding / residual / attention multipliers and logits scaling, none 1
    "granite": ("GraniteConfig", {"embedding_multiplier": 3.0, "residual_multiplier": 0.6,
                                  "attention_multiplier": 0.2, "logits_scaling": 1.5}),
    # Granite 3.x MoE: the multipliers over 4 stacked experts, top-2 (softmax over the top 2)
    "granite_moe": ("GraniteMoeConfig", {"embedding_multiplier": 3.0,
                                         "residual_multiplier": 0.6,
                                         "attention_multiplier": 0.2, "logits_scaling": 1.5,
                                         "num_local_experts": 4, "num_experts_per_tok": 2,
                                         "intermediate_size": 32}),
    # OLMo 2: post-norms only, q/k RMSNorm over the whole projections, biased attention
    "olmo2": ("Olmo2Config", {"attention_bias": True}),
    # OLMo 2 with one KV head: at TP=2 both ranks hold it, and k_norm's mean covers it twice
    "olmo2_mqa": ("Olmo2Config", {"num_key_value_heads": 1}),
    # GLM-4-9B: q/k/v bias, interleaved RoPE on half of each head (head_dim 32), fused gate/up
    "glm": ("GlmConfig", {"head_dim": 32}),
    # GLM-4-0414: GLM plus post-attention and post-MLP norms; RoPE on a quarter of each head
    "glm4": ("Glm4Config", {"head_dim": 16, "partial_rotary_factor": 0.25}),
    # Mixture-of-Experts: 4-8 small experts, top-2 (Mixtral renormalizes the top-k weights)
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                  "intermediate_size": 64}),
    # Qwen2-MoE: sigmoid-gated shared expert, no top-k renormalization, layer 1 dense
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48,
                                     "norm_topk_prob": False, "mlp_only_layers": [1]}),
    # Qwen2-MoE with shared_expert_intermediate_size 0: transformers saves the width-0 shared
    # expert's empty tensors and its [1, hidden] gate
    "qwen2_moe_no_shared": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                               "moe_intermediate_size": 32,
                                               "shared_expert_intermediate_size": 0,
                                               "norm_topk_prob": False, "mlp_only_layers": [1]}),
    # Qwen3-MoE: q/k norm, 8 experts, renormalized top-2
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True,
                                     "head_dim": 32}),
    # Qwen3-MoE with 256-wide rows (whole K-quant blocks of 256) for the GGUF K-quant tests
    "qwen3_moe_256": ("Qwen3MoeConfig", {"hidden_size": 256, "num_experts": 4,
                                         "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                                         "norm_topk_prob": True, "head_dim": 64}),
    # DeepSeek-V2-Lite style: MLA without q LoRA (latent 32 + RoPE key 8 per token), layer 0
    # dense, layer 1 DeepSeekMoE (8 experts in 4 groups, best 2 groups, top-2, 2 shared
    # experts), YaRN with mscale != mscale_all_dim (RoPE and softmax scale both adjusted)
    "deepseek_v2": ("DeepseekV2Config", {
        **_MLA_DIMS, "q_lora_rank": None, "n_shared_experts": 2,
        "topk_method": "group_limited_greedy", "routed_scaling_factor": 1.5,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "mscale": 0.707, "mscale_all_dim": 1.0}}),
    # DeepSeek-V2 with transformers' mlp_bias: biased dense and shared-expert MLPs
    "deepseek_v2_mlp_bias": ("DeepseekV2Config", {
        **_MLA_DIMS, "q_lora_rank": None, "n_shared_experts": 1, "mlp_bias": True}),
    # DeepSeek-V2 with n_shared_experts 0: transformers saves the width-0 shared MLP's empty
    # tensors, every layer MoE, greedy top-2 routing
    "deepseek_v2_no_shared": ("DeepseekV2Config", {
        **_MLA_DIMS, "q_lora_rank": None, "n_shared_experts": 0, "first_k_dense_replace": 0,
        "topk_method": "greedy", "routed_scaling_factor": 1.0}),
    # DeepSeek-V3 style: q LoRA, sigmoid "noaux_tc" routing with a random correction bias,
    # renormalized and scaled top-2, 1 shared expert, interleaved RoPE
    "deepseek_v3": ("DeepseekV3Config", {
        **_MLA_DIMS, "q_lora_rank": 48, "n_shared_experts": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "rope_interleave": True}),
    # DeepSeek-V3 variants: RoPE on two halves (rope_interleave false), every layer MoE, one
    # routing group (noaux_tc without a group limit), routing weights not renormalized
    "deepseek_v3_variant": ("DeepseekV3Config", {
        **_MLA_DIMS, "q_lora_rank": 48, "n_shared_experts": 1, "norm_topk_prob": False,
        "routed_scaling_factor": 1.5, "rope_interleave": False, "first_k_dense_replace": 0,
        "n_group": 1, "topk_group": 1}),
    # DeepSeek-V3 with moe_layer_freq 2, saved by transformers (which ignores it: both layers
    # MoE; DeepSeek's rule would make layer 1 dense): kvflow follows the checkpoint's layout
    "deepseek_v3_moe_layer_freq": ("DeepseekV3Config", {
        **_MLA_DIMS, "q_lora_rank": 48, "n_shared_experts": 1, "first_k_dense_replace": 0,
        "moe_layer_freq": 2, "routed_scaling_factor": 2.5}),
}


@dataclass
class TinyModel:
    """A saved tiny model.

    Attributes:
        name: key in ``TINY_MODEL_SPECS``.
        path: folder with config.json, model.safetensors and the tokenizer files.
        hf_model: the same model in transformers (float32, eval mode).
        vocab_size: model vocabulary size (== tokenizer size).
        eos_token_id: the tokenizer's and config's EOS id.
    """

    name: str
    path: str
    hf_model: Any
    vocab_size: int
    eos_token_id: int


def _tokenizer_corpus() -> list[str]:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
             "kvflow", "pages", "keys", "and", "values", "through", "blocks", "of", "tokens;",
             "prefix", "caching", "reuses", "them,", "chunked", "prefill", "splits", "long",
             "prompts,", "and", "preemption", "recomputes", "what", "it", "evicted"]
    lines = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    return lines + ["0123456789 ABCDEFGHIJKLMNOPQRSTUVWXYZ !?.,:;-+*/=()[]{}<>\"'"] * 3


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` of ``TOKENIZER_VOCAB`` tokens (ids 0 and 1
    are ``<eos>`` and ``<bos>``), trained deterministically on a fixed corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=[EOS_TOKEN, BOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_tokenizer_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=BOS_TOKEN)
    assert len(fast) == TOKENIZER_VOCAB and fast.eos_token_id == 0
    return fast


def _randomize_(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights with peaked logits: N(0, 0.1) matrices, norms 1 + N(0, 0.2), biases
    N(0, 0.2). Parameters (and DeepSeek-V3's routing correction bias, a buffer) are visited in
    name order, so the draw is deterministic."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [*model.named_parameters(),
               *((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))]
    with torch.no_grad():
        for name, param in sorted(tensors, key=lambda kv: kv[0]):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.2 * noise)
            else:
                param.copy_(0.1 * noise)


def build_tiny_model(name: str, folder: str, tokenizer: Any, seed: int = 0) -> TinyModel:
    """Build, randomize and save one tiny model (and the tokenizer) into ``folder``."""
    import transformers

    config_cls_name, overrides = TINY_MODEL_SPECS[name]
    config_cls = getattr(transformers, config_cls_name)
    kwargs: dict[str, Any] = {
        "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.eos_token_id}
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    config.architectures = kwargs.get("architectures") or \
        [config_cls_name.replace("Config", "ForCausalLM")]
    model_cls = getattr(transformers, config.architectures[0])
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    if config.tie_word_embeddings:
        model.tie_weights()
    _randomize_(model, seed)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return TinyModel(name, folder, model, config.vocab_size, tokenizer.eos_token_id)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory,
                       tiny_tokenizer: Any) -> Callable[[str], TinyModel]:
    """``factory(name) -> TinyModel`` for a name in ``TINY_MODEL_SPECS``; each model is built
    once per session (its seed derives from its name) and saved under a session tmp dir."""
    cache: dict[str, TinyModel] = {}

    def factory(name: str) -> TinyModel:
        if name not in cache:
            folder = str(tmp_path_factory.mktemp(f"tiny_{name}"))
            seed = zlib.crc32(name.encode())  # stable when specs are added
            cache[name] = build_tiny_model(name, folder, tiny_tokenizer, seed)
        return cache[name]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: Callable[[str], TinyModel]) -> TinyModel:
    """The tiny Llama (untied, plain RoPE)."""
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_chat_model(tiny_llama: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama copied to a folder of its own with ``TINY_CHAT_TEMPLATE`` added; returns
    the folder (the model the e2e servers serve most)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny_chat") / "model"
    shutil.copytree(tiny_llama.path, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def start_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Any]:
    """``start_server(model, args, env=None, threads=1, wait=True)`` -> a ready
    ``ServerProcess`` (``ServerStarter`` in tests/e2e/conftest.py, for tests/e2e and
    tests/multimodal); every server started is stopped at the end of the session (modules
    may stop theirs earlier). ``wait=False`` returns it starting: the caller starts others
    (they come up side by side) and waits with ``ready_side_by_side`` (or
    ``wait_ready_or_stop``). A module's servers may have been started ahead (see
    ``_prestart_next_module`` and :func:`_e2e_servers_started_early`);
    ``start_server.declared(request, index, wait=True)`` gives one of them. Servers started
    ahead and never used are warned about at the end, unless the session stopped early
    (``-x``, ``--maxfail``)."""
    from tests.e2e.conftest import ServerStarter

    starter = ServerStarter(tmp_path_factory)
    yield starter
    session = request.session
    starter.stop_all(warn_unused=not (session.shouldfail or session.shouldstop))


@pytest.fixture(scope="session", autouse=True)
def _e2e_servers_started_early(request: pytest.FixtureRequest) -> None:
    """When the session runs tests in tests/e2e, start the servers of its first module there
    that declares them as the session starts (``prestart_first_module`` in
    tests/e2e/conftest.py): they come up on the core that the modules before tests/e2e leave
    idle. Skipped when a fixture of that declaration is not one of this file's (the servers
    then start as before, in that module's set-up), and under pytest-xdist (see
    ``_prestart_next_module``)."""
    e2e = os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2e")
    if os.environ.get("PYTEST_XDIST_WORKER") or not any(
            os.path.dirname(str(item.path)) == e2e for item in request.session.items):
        return
    from tests.e2e.conftest import prestart_first_module

    starter = request.getfixturevalue("start_server")
    try:
        prestart_first_module(request.session, starter, request.getfixturevalue)
    except pytest.FixtureLookupError:
        pass


@pytest.fixture(scope="session")
def _session_num_threads() -> int:
    """``torch.get_num_threads()`` as the session starts (after this conftest set it)."""
    return torch.get_num_threads()


@pytest.fixture(autouse=True)
def _torch_num_threads_restored(_session_num_threads: int) -> Iterator[None]:
    """Put torch's intra-op thread count back after each test that changed it (an engine
    started in-process sets it for the whole process): fp32 results can differ in the last
    bits between thread counts, so a later bitwise comparison would pass or fail by which
    tests ran before it. ``set_num_threads`` is called only when the count differs."""
    yield
    if torch.get_num_threads() != _session_num_threads:
        torch.set_num_threads(_session_num_threads)


@pytest.fixture(autouse=True)
def _kvflow_log_level_restored() -> Iterator[None]:
    """Put the ``kvflow`` logger's level back after each test: ``kvflow serve`` run in-process
    (``cli.main(["serve", ...])``) sets it for the whole process (to its --uvicorn-log-level),
    and a later in-process ``kvflow generate`` would then print INFO lines on stderr, so a test
    reading stderr passed or failed by which tests ran before it in the same process."""
    logger = logging.getLogger("kvflow")
    level = logger.level
    yield
    logger.setLevel(level)


def _assert_no_leaked_blocks(llm: Any) -> None:
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    pool = core.kv_cache_manager.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_usable_blocks, \
        f"{pool.num_usable_blocks - pool.num_free_blocks} KV blocks leaked"


@pytest.fixture
def assert_no_leaks() -> Callable[[Any], None]:
    """``assert_no_leaks(llm)``: once every request has finished, the block pool passes
    ``check_invariants`` and every usable block is free again (no leaked reference)."""
    return _assert_no_leaked_blocks


@pytest.fixture(params=["native", "torch"], ids=["native_cpu", "torch_cpu"])
def cpu_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with kvflow's native C CPU kernels on ("native") and off ("torch", as
    ``KVFLOW_NATIVE_CPU=0``: torch attention backend, oneDNN GEMMs, torch norm/activation/
    rotary), whatever the suite's own setting: CI covers both paths in one run. Use it on the
    few engine tests that go through every kernel (not on the whole suite, which would double
    its time)."""
    from kvflow.kernels import cpu_native

    monkeypatch.setenv("KVFLOW_NATIVE_CPU", "1" if request.param == "native" else "0")
    cpu_native.native_cpu_kernels.cache_clear()
    yield request.param
    cpu_native.native_cpu_kernels.cache_clear()  # re-read once monkeypatch restores the env


@pytest.fixture(scope="session")
def smollm2_llm() -> Any:
    """One engine on the packaged SmolLM2-135M-Instruct GGUF (fp32, chunked prefill of 16
    tokens a step, 256 blocks, max_model_len 256), shared by the tests that only generate
    greedily with it (tests/models/test_gguf_loader.py, tests/test_stop_strings.py): the load
    dequantizes every weight, ~5 s on 2 busy cores, once instead of once per module."""
    from kvflow import LLM

    return LLM(model="SmolLM2-135M-Instruct", dtype="float32", max_num_batched_tokens=16,
               num_kv_blocks=256, max_model_len=256)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (a worker's collection, the order xdist hands files out in with
    ``--no-loadscope-reorder``): the costliest test files first (``tests/file_order.py``), so
    the last files the two workers run are short ones. A serial run keeps the collection
    order (its servers and Triton runs are started ahead in that order)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from tests.file_order import costliest_files_first, read_costs

    items[:] = costliest_files_first(items, read_costs())


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``--dist loadfile`` (pyproject's addopts): xdist's file scheduler, but the
    files sharing a costly session fixture go to one worker together
    (``tests/file_order.py``'s ``SHARED_STATE_GROUPS``). Other ``--dist`` modes: xdist's own
    (None)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.file_order import file_scheduler

    return file_scheduler(config, log)
