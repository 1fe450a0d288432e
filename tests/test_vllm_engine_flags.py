"""vLLM's engine flags on ``kvflow generate/serve`` and as ``LLM(...)`` keywords (README
"Coming from vLLM"): each maps onto kvflow's own setting (values hand-computed), or is
refused with a message naming it and why. Effects: --override-generation-config merged over a
generation_config.json written here, --trust-remote-code letting transformers load a config
class from the model folder's own Python file, --enable-chunked-prefill and
--long-prefill-token-threshold refused for an encoder-only model (which runs prompts whole),
--long-prefill-token-threshold capping each request's tokens per step on the tiny Llama (the
same greedy tokens as without it)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvflow.config import EngineConfig, parse_bytes
from kvflow.entrypoints.cli import build_parser


def _engine(*argv: str, command: str = "serve") -> EngineConfig:
    return EngineConfig.from_cli_args(build_parser().parse_args([command, *argv]))


def test_flags_map_onto_kvflow_settings():
    config = _engine("--enable-chunked-prefill", "--kv-cache-memory-bytes", "3G",
                     "--scheduling-policy", "priority", "--limit-mm-per-prompt",
                     '{"image": 3, "video": 0}', "--trust-remote-code", "--tokenizer-mode",
                     "hf", "--override-generation-config", '{"temperature": 0.5}')
    assert config.scheduler_config.enable_chunked_prefill is True
    assert config.cache_config.kv_cache_memory == "3G"
    assert parse_bytes(config.cache_config.kv_cache_memory) == 3 * 2**30
    assert config.scheduler_config.policy == "priority"
    assert config.multimodal_config.max_images_per_prompt == 3
    assert config.multimodal_config.max_videos_per_prompt == 0
    assert config.model_config.trust_remote_code is True
    assert config.model_config.tokenizer_options == {"trust_remote_code": True}
    assert config.model_config.override_generation_config == {"temperature": 0.5}
    blocks = _engine("--num-gpu-blocks-override", "64", command="generate")
    assert blocks.cache_config.num_kv_blocks == 64
    nested = _engine("--limit-mm-per-prompt", '{"image": {"count": 2}}')
    assert nested.multimodal_config.max_images_per_prompt == 2
    video = _engine("--limit-mm-per-prompt", '{"video": 3}', "--media-io-kwargs",
                    '{"video": {"num_frames": 8}}')
    assert video.multimodal_config.max_videos_per_prompt == 3
    assert video.multimodal_config.video_num_frames() == 8
    default = _engine()
    assert default.model_config.tokenizer_options == {"trust_remote_code": False}
    assert default.scheduler_config.enable_chunked_prefill is None
    assert default.multimodal_config.video_num_frames() == 32


def test_llm_keywords():
    """``LLM(...)`` takes vLLM's names too (EngineConfig.from_kwargs)."""
    config = EngineConfig.from_kwargs(kv_cache_memory_bytes=2**30, num_gpu_blocks_override=None,
                                      enable_chunked_prefill=True, trust_remote_code=True,
                                      limit_mm_per_prompt={"image": 5},
                                      override_generation_config={"top_k": 7})
    assert config.cache_config.kv_cache_memory == 2**30
    assert config.multimodal_config.max_images_per_prompt == 5
    assert config.model_config.override_generation_config == {"top_k": 7}
    with pytest.raises(ValueError, match="name the same option"):
        EngineConfig.from_kwargs(kv_cache_memory_bytes="1G", kv_cache_memory="1GiB")


@pytest.mark.parametrize("text,size", [("1G", 2**30), ("1g", 10**9), ("25.6k", 25600),
                                       ("2T", 2 * 2**40), ("512M", 512 * 2**20),
                                       ("2GiB", 2 * 2**30), ("512MB", 512 * 10**6)])
def test_vllm_sizes(text, size):
    """vLLM's human-readable sizes: lower case decimal, upper case binary (kvflow's units
    unchanged)."""
    assert parse_bytes(text) == size


@pytest.mark.parametrize("kwargs,needle", [
    ({"enable_chunked_prefill": False}, "turning chunked prefill off"),
    ({"tokenizer_mode": "mistral"}, "tokenizer_mode='mistral' is not available"),
    ({"tokenizer_mode": "slow"}, "always loads the fast tokenizer"),
    ({"limit_mm_per_prompt": '{"video": 1}', "max_videos_per_prompt": 2}, "give one"),
    ({"limit_mm_per_prompt": '{"video": -1}'}, "video=-1 must be an integer >= 0"),
    ({"media_io_kwargs": '{"video": {"fps": 2}}'}, "reads only"),
    ({"media_io_kwargs": '{"video": {"num_frames": 0}}'}, "num_frames=0 must be"),
    ({"limit_mm_per_prompt": {"audio": 2}}, "audio=2 is refused"),
    ({"limit_mm_per_prompt": {"image": 0}}, "image=0 is refused"),
    ({"limit_mm_per_prompt": {"image": 2}, "max_images_per_prompt": 3}, "give one"),
    ({"limit_mm_per_prompt": {"image": {"count": 2, "width": 64}}}, "['width']"),
    ({"limit_mm_per_prompt": "[2]"}, "must be a JSON object"),
    ({"override_generation_config": '{"do_sample": true}'}, "['do_sample']"),
    ({"override_generation_config": "{bad"}, "is not a JSON object"),
    ({"kv_cache_memory_bytes": "1.5G"}, "takes a whole number"),
])
def test_refused(kwargs, needle):
    with pytest.raises(ValueError, match=None) as info:
        EngineConfig.from_kwargs(**kwargs)
    assert needle in str(info.value)


def test_refusal_names_the_typed_flag(capsys):
    """From the command line: one line, status 2, the flag as typed (before any model)."""
    from kvflow.entrypoints.cli import main

    rc = main(["generate", "--no-enable-chunked-prefill", "--prompt", "x"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("kvflow: error: turning chunked prefill off "
                             "(--no-enable-chunked-prefill, enable_chunked_prefill False)")


def test_engine_flags_in_a_config_file(tmp_path):
    from kvflow.entrypoints.config_file import expand_config_file

    path = tmp_path / "engine.yaml"
    path.write_text("enable-chunked-prefill: true\nlimit-mm-per-prompt: {image: 2}\n"
                    "trust-remote-code: true\nkv-cache-memory-bytes: 1G\n"
                    "override-generation-config: {temperature: 0.25}\n")
    parser = build_parser()
    args = parser.parse_args(expand_config_file(parser, ["serve", "--config", str(path)]))
    config = EngineConfig.from_cli_args(args)
    assert config.scheduler_config.enable_chunked_prefill is True
    assert config.multimodal_config.max_images_per_prompt == 2
    assert config.model_config.trust_remote_code is True
    assert parse_bytes(config.cache_config.kv_cache_memory) == 2**30
    assert config.model_config.override_generation_config == {"temperature": 0.25}


def test_override_generation_config_merges_over_the_file(tmp_path):
    from kvflow.models.generation_config import load_sampling_defaults
    from kvflow.models.model_resolver import ModelSource

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 64}))
    source = ModelSource(kind="hf", path=str(tmp_path), name="m")
    overrides = {"temperature": 0.2, "top_k": 5}
    assert load_sampling_defaults(source, "auto", overrides) == {
        "temperature": 0.2, "top_p": 0.9, "max_tokens": 64, "top_k": 5}
    assert load_sampling_defaults(source, "none", overrides) == {"temperature": 0.2,
                                                                 "top_k": 5}
    assert load_sampling_defaults(source, "auto") == {"temperature": 0.6, "top_p": 0.9,
                                                      "max_tokens": 64}
    with pytest.raises(ValueError, match="override_generation_config: .*temperature"):
        load_sampling_defaults(source, "auto", {"temperature": -1.0})


REMOTE_CONFIG = '''from transformers import LlamaConfig


class KvflowRemoteConfig(LlamaConfig):
    model_type = "kvflow_remote_test"
'''


def test_trust_remote_code_reaches_autoconfig(tiny_llama, tmp_path):
    """A model folder whose config.json names its own config class (auto_map): refused
    without --trust-remote-code, loaded through the folder's code with it."""
    import shutil

    from kvflow.models.loader import load_hf_config
    from kvflow.models.model_resolver import ModelSource

    folder = tmp_path / f"remote_{tmp_path.name}"
    shutil.copytree(tiny_llama.path, folder)
    (folder / "configuration_remote.py").write_text(REMOTE_CONFIG)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="kvflow_remote_test",
                  auto_map={"AutoConfig": "configuration_remote.KvflowRemoteConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    source = ModelSource(kind="hf", path=str(folder), name="remote")
    with pytest.raises(ValueError, match="custom code"):
        load_hf_config(source)
    loaded = load_hf_config(source, trust_remote_code=True)
    assert type(loaded).__name__ == "KvflowRemoteConfig"
    assert loaded.hidden_size == config["hidden_size"]


def test_trust_remote_code_reaches_the_draft_models_config(tiny_llama, tmp_path):
    """A draft model folder whose config names its own class: refused without
    --trust-remote-code (the draft's config read as the target's), drafting with it; the
    greedy output is the target's own (transformers', as speculation leaves it)."""
    import shutil

    import torch

    from kvflow import LLM, SamplingParams

    folder = tmp_path / "remote_draft"
    shutil.copytree(tiny_llama.path, folder)
    (folder / "configuration_remote.py").write_text(REMOTE_CONFIG)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="kvflow_remote_test",
                  auto_map={"AutoConfig": "configuration_remote.KvflowRemoteConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    spec = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 2,
            "adaptive": False}
    kwargs = {"model": tiny_llama.path, "dtype": "float32", "device": "cpu",
              "num_kv_blocks": 64, "block_size": 4, "speculative_config": spec}
    with pytest.raises(ValueError, match="custom code"):
        LLM(**kwargs)
    llm = LLM(**kwargs, trust_remote_code=True)
    prompt = [219, 319, 53, 135, 37, 115, 38]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6,
                                                   ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        ref = tiny_llama.hf_model.generate(torch.tensor([prompt]), do_sample=False,
                                           max_new_tokens=6, min_new_tokens=6,
                                           eos_token_id=None, pad_token_id=0)
    assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
    assert out.metrics.num_draft_tokens > 0  # the draft proposed


def test_chunked_prefill_refused_for_an_encoder():
    from kvflow.core.unread_options import check_no_kv_cache_settings

    bert = SimpleNamespace(architectures=["BertModel"])
    with pytest.raises(ValueError, match="enable_chunked_prefill=True: BertModel is an "
                                         "encoder-only model"):
        check_no_kv_cache_settings(EngineConfig.from_kwargs(enable_chunked_prefill=True), bert)
    check_no_kv_cache_settings(EngineConfig.from_kwargs(), bert)  # nothing given: fine


def test_long_prefill_token_threshold_refused_for_an_encoder():
    from kvflow.core.unread_options import check_no_kv_cache_settings

    bert = SimpleNamespace(architectures=["BertModel"])
    config = _engine("--long-prefill-token-threshold", "64")
    assert config.scheduler_config.long_prefill_token_threshold == 64
    with pytest.raises(ValueError, match="long_prefill_token_threshold=64: BertModel is an "
                                         "encoder-only model"):
        check_no_kv_cache_settings(config, bert)


def test_long_prefill_token_threshold_caps_chunks_beside_other_requests(tiny_llama):
    """Threshold 8, budget 32: while both requests are unfinished no request computes more
    than 8 tokens a step (the 40-token prompt is split 8 by 8, next to the short one's
    decodes); the tokens are those of the engine without the threshold. A threshold above
    max_model_len is refused, as vLLM refuses it."""
    from kvflow import LLM, SamplingParams

    common = {"model": tiny_llama.path, "dtype": "float32", "block_size": 4,
              "num_kv_blocks": 80, "max_num_batched_tokens": 32}
    prompts = [[5, 6, 7], [(3 * i) % 300 + 2 for i in range(40)]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    capped = LLM(**common, long_prefill_token_threshold=8)
    scheduler, steps = capped.engine.core.scheduler, []
    schedule = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        crowded = len(scheduler.requests) > 1
        out = schedule(*args, **kwargs)
        steps.append((crowded, dict(out.num_scheduled_tokens)))
        return out

    scheduler.schedule = recording_schedule
    got = [o.outputs[0].token_ids for o in capped.generate(prompts, params, use_tqdm=False)]
    plain = LLM(**common)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert all(n <= 8 for crowded, step in steps if crowded for n in step.values())
    assert [step.get("1") for _, step in steps[:5]] == [8, 8, 8, 8, 8]  # 40 = 5 x 8
    with pytest.raises(ValueError, match=r"long_prefill_token_threshold=300 cannot be greater "
                                         r"than max_model_len \(256\)"):
        LLM(**common, long_prefill_token_threshold=300)


def test_prefix_caching_hash_algo_refused_for_an_encoder():
    """An encoder hashes no block: vLLM's hash asked for would never be read."""
    from kvflow.core.unread_options import check_no_kv_cache_settings

    bert = SimpleNamespace(architectures=["BertModel"])
    with pytest.raises(ValueError, match="prefix_caching_hash_algo='sha256': BertModel is an "
                                         "encoder-only model"):
        check_no_kv_cache_settings(
            EngineConfig.from_kwargs(prefix_caching_hash_algo="sha256"), bert)
    check_no_kv_cache_settings(EngineConfig.from_kwargs(prefix_caching_hash_algo="blake2b"),
                               bert)  # the default, spelled out: what the encoder does anyway


def test_prefix_caching_hash_algo_refused_where_pooling_turns_caching_off():
    from kvflow.core.unread_options import check_prefix_caching_pooling

    config = EngineConfig.from_kwargs(prefix_caching_hash_algo="sha256_cbor")
    with pytest.raises(ValueError, match="prefix_caching_hash_algo='sha256_cbor': this engine "
                                         "embeds with mean pooling"):
        check_prefix_caching_pooling(config, "mean")
    check_prefix_caching_pooling(config, "last")  # last-token pooling caches prefixes
    check_prefix_caching_pooling(config, None)  # a generating engine


@pytest.mark.parametrize("argv", [["--kv-cache-memory", "1GiB", "--kv-cache-memory-bytes=2G"],
                                  ["--policy", "fcfs", "--scheduling-policy", "priority"]])
def test_both_names_of_a_setting_refused(capsys, argv):
    """argparse kept the later of the two in silence."""
    from kvflow.entrypoints.cli import main

    rc = main(["generate", *argv, "--prompt", "x"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1, err
    first, second = argv[0], argv[2].split("=")[0]
    assert err[0] == (f"kvflow: error: {first} and {second} name the same setting (one is "
                      "vLLM's name for it): give one")


# vLLM 0.32's human_readable_int_or_auto (vllm/utils/argparse_utils.py) on these strings,
# hand-computed: k m g t decimal, K M G T binary with a whole number, -1 / auto its auto-fit
# (kvflow: unset, the model's length capped to the KV cache).
HUMAN_INTS = [("2k", 2000), ("1k", 1000), ("1K", 1024), ("25.6k", 25600), ("2048", 2048),
              (" 4k ", 4000), ("1.5m", 1_500_000), ("2M", 2 * 2**20), ("0.5k", 500),
              ("1.9999k", 1999)]


@pytest.mark.parametrize("text,value", [*HUMAN_INTS, ("-1", None), ("auto", None),
                                        ("AUTO", None)])
def test_max_model_len_takes_vllms_spellings(text, value):
    """``--max-model-len 2k`` was refused by argparse (invalid int value: '2k'); vLLM reads
    it with human_readable_int_or_auto."""
    assert _engine("--max-model-len", text).model_config.max_model_len == value


@pytest.mark.parametrize("text,value", HUMAN_INTS)
def test_max_num_batched_tokens_takes_vllms_spellings(text, value):
    """vLLM reads --max-num-batched-tokens with human_readable_int too."""
    config = _engine("--max-num-batched-tokens", text, command="generate")
    assert config.scheduler_config.max_num_batched_tokens == value


def test_human_readable_ints_in_a_config_file_and_llm(tmp_path):
    """The config file's values go through the same parsing; ``LLM(max_model_len=-1)`` is
    vLLM's auto-fit there too (vLLM's LLM takes no "2k" string: an int field)."""
    from kvflow.entrypoints.config_file import expand_config_file

    path = tmp_path / "engine.yaml"
    path.write_text("max-model-len: 2k\nmax-num-batched-tokens: 1K\n")
    parser = build_parser()
    args = parser.parse_args(expand_config_file(parser, ["serve", "--config", str(path)]))
    config = EngineConfig.from_cli_args(args)
    assert config.model_config.max_model_len == 2000
    assert config.scheduler_config.max_num_batched_tokens == 1024
    assert EngineConfig.from_kwargs(max_model_len=-1).model_config.max_model_len is None
    with pytest.raises(ValueError, match="max_model_len=-2 must be >= 1"):
        EngineConfig.from_kwargs(max_model_len=-2)


@pytest.mark.parametrize("text,message", [
    ("2x", ("argument --max-model-len: '2x' is not an integer: give e.g. 2048, 2k (2000) or "
            "2K (2048)")),
    ("1.5K", ("argument --max-model-len: '1.5K': a binary suffix (K) takes a whole number; "
              "did you mean 1.5k (decimal)?"))])
def test_bad_human_readable_int_names_the_flag(capsys, text, message):
    """One error line, status 2, naming the flag (as vLLM refuses these strings)."""
    from kvflow.entrypoints.cli import main

    with pytest.raises(SystemExit) as info:
        main(["generate", "--max-model-len", text, "--prompt", "x"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert info.value.code == 2
    assert err == [f"kvflow: error: {message} (see kvflow generate --help)"]


@pytest.mark.parametrize("argv,line", [
    (["--kv-cache-memory", "10XB"],
     ("--kv-cache-memory='10XB' is invalid: cannot parse memory size '10XB': expected e.g. "
     "2GiB, 512MB")),
    (["--kv-cache-memory-bytes", "1.5G"],
     ("--kv-cache-memory-bytes='1.5G' is invalid: cannot parse memory size '1.5G': a binary "
     "suffix (G) takes a whole number; did you mean 1.5g (decimal)?")),
    (["--kv-cache-memory", "0"],
     "--kv-cache-memory='0' is invalid: memory size '0' must be positive"),
    (["--swap-space", "10XB"],
     ("--swap-space='10XB' is invalid: cannot parse memory size '10XB': expected e.g. 2GiB, "
     "512MB")),
], ids=["kv_cache_memory", "vllm_alias", "zero", "swap_space"])
def test_bad_byte_size_names_the_flag(capsys, argv, line):
    """``--kv-cache-memory 10XB`` said "cannot parse memory size '10XB'" without naming the
    flag; now the flag as typed, as other refused values are (one line, status 2)."""
    from kvflow.entrypoints.cli import main

    rc = main(["generate", *argv, "--prompt", "x"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and err == [f"kvflow: error: {line}"], err


def test_bad_byte_size_names_the_keyword_and_the_file_key(tmp_path, capsys):
    """``LLM(kv_cache_memory=...)`` / ``swap_space`` name the keyword; a --config file's
    value names the file's key."""
    from kvflow.entrypoints.cli import main

    for name in ("kv_cache_memory", "swap_space"):
        with pytest.raises(ValueError) as info:
            EngineConfig.from_kwargs(**{name: "10XB"})
        assert str(info.value) == (f"{name}='10XB' is invalid: cannot parse memory size "
                                   "'10XB': expected e.g. 2GiB, 512MB")
    path = tmp_path / "engine.yaml"
    path.write_text("kv-cache-memory: 10XB\n")
    assert main(["generate", "--config", str(path), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"kvflow: error: {path}: key 'kv-cache-memory': kv_cache_memory='10XB' is invalid: "
        "cannot parse memory size '10XB': expected e.g. 2GiB, 512MB")
