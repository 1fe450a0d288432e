"""``kvflow bench throughput``: offline throughput on random-token prompts, optionally side by
side with HF transformers' static-batch ``generate`` on the same prompts in the same process.

Workload (CPU-W1 of docs/benchmarks.md): ``num_prompts`` prompts of ``input_len`` token
ids drawn with numpy ``default_rng(seed).integers(3, min(vocab, 32000))``, ``output_len`` greedy
tokens each, EOS ignored. Throughput = generated tokens / wall time of the whole batch (prefill
included).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvflow.bench.checks import (
    ensure_parent_dir,
    require_fits,
    require_one_engine,
    require_positive,
)
from kvflow.config import EngineConfig
from kvflow.lora.path_flag import add_lora_path_arg, lora_request_from_flags


@dataclass
class ThroughputResult:
    engine: str
    num_prompts: int
    input_len: int
    output_len: int
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    high = min(vocab_size, 32000)
    rng = np.random.default_rng(seed)
    return rng.integers(3, high, (num_prompts, input_len)).tolist()


def _result(engine: str, prompts: list[list[int]], output_len: int, elapsed: float):
    n, inp = len(prompts), sum(len(p) for p in prompts)
    out = n * output_len
    return ThroughputResult(engine, n, inp // n, output_len, elapsed, n / elapsed, out / elapsed,
                            (inp + out) / elapsed)


def run_kvflow(llm, prompts: list[list[int]], output_len: int,
               lora_request=None) -> ThroughputResult:
    """Time ``llm.generate`` over every prompt (greedy, ``ignore_eos``, ``output_len`` tokens
    each; through ``lora_request``'s adapter when given) after a two-prompt warm-up and a
    prefix-cache reset.

    Raises:
        RuntimeError: if kvflow did not produce exactly ``output_len`` tokens per prompt.
    """
    from kvflow.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False, lora_request=lora_request)  # warm-up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != len(prompts) * output_len:
        raise RuntimeError(f"kvflow produced {produced} tokens, expected "
                           f"{len(prompts) * output_len}")
    return _result("kvflow", prompts, output_len, elapsed)


def load_hf_model(llm, dtype):
    """The same weights in HF transformers (from the HF folder, or transformers' GGUF loader)."""
    import os

    from transformers import AutoModelForCausalLM

    source = llm.engine.core.source
    if source.kind == "gguf":
        folder, name = os.path.split(source.path)
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype).eval()


def run_hf(model, prompts: list[list[int]], output_len: int, batch_size: int):
    """HF ``generate`` with static batches of ``batch_size`` (all prompts have equal length)."""
    import torch

    def gen(batch: list[list[int]], n: int) -> None:
        ids = torch.tensor(batch)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        gen(prompts[:2], 4)  # warm-up
        start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            gen(prompts[i:i + batch_size], output_len)
        elapsed = time.perf_counter() - start
    return _result("hf-transformers", prompts, output_len, elapsed)


def require_hf_can_run(hf_config) -> None:
    """Refuse ``--compare hf`` up front (before the kvflow run) for a GPTQ / AWQ checkpoint
    that transformers cannot load here: it runs those only through the ``gptqmodel`` package
    (and GPTQ also through ``optimum``), which kvflow does not need or install.

    Raises:
        ValueError: naming the checkpoint's ``quant_method`` and the missing packages.
    """
    from transformers.utils import is_gptqmodel_available, is_optimum_available

    ckpt = getattr(hf_config, "quantization_config", None)
    if ckpt is not None and not isinstance(ckpt, dict):
        ckpt = ckpt.to_dict() if hasattr(ckpt, "to_dict") else dict(vars(ckpt))
    method = (ckpt or {}).get("quant_method")
    if method not in ("gptq", "awq"):
        return
    missing = [name for name, ok in (("gptqmodel", is_gptqmodel_available()),
                                     ("optimum", method == "awq" or is_optimum_available()))
               if not ok]
    if missing:
        raise ValueError(f"--compare hf: transformers loads this {method} checkpoint "
                         f"(quantization_config.quant_method={method!r}) only with "
                         f"{' and '.join(missing)} installed (pip install "
                         f"{' '.join(missing)}); drop --compare hf or install them")


def _print(result: ThroughputResult) -> None:
    print(f"{result.engine:>16}: {result.elapsed_s:7.2f} s  {result.requests_per_s:7.2f} req/s  "
          f"{result.output_tokens_per_s:9.1f} output tok/s  {result.total_tokens_per_s:9.1f} "
          "total tok/s")


def _cmd_throughput(args: argparse.Namespace) -> int:
    from kvflow.offline.llm import LLM

    require_positive(num_prompts=args.num_prompts, input_len=args.input_len,
                     output_len=args.output_len, hf_batch_size=args.hf_batch_size)
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0 (it seeds the random prompts), got {args.seed}")
    ensure_parent_dir(args.output_json, "--output-json")
    require_one_engine(args.data_parallel_size, "throughput")
    config = EngineConfig.from_cli_args(args)
    lora = lora_request_from_flags(args.lora_path, config.lora_config.enable_lora,
                                   "kvflow bench throughput")
    if lora is not None and args.compare == "hf":
        raise ValueError("--compare hf runs the base model: it cannot be combined with "
                         "--lora-path")
    quant = config.model_config.quantization
    if quant in ("int8", "int4", "fp8") and args.compare == "hf":  # the ratio would mislead
        raise ValueError(f"--compare hf runs the checkpoint's weights unquantized: it cannot "
                         f"be compared against --quantization {quant} (drop one of them)")
    llm = LLM.from_engine_config(config)
    if args.compare == "hf":
        require_hf_can_run(llm.engine.core.hf_config)
    require_fits(llm.engine.core.max_model_len, args.input_len, args.output_len)
    prompts = random_prompts(args.num_prompts, args.input_len,
                             llm.engine.core.hf_config.vocab_size, args.seed)
    results = [run_kvflow(llm, prompts, args.output_len, lora)]
    _print(results[0])
    if args.compare == "hf":
        model = load_hf_model(llm, llm.engine.core.dtype)
        results.append(run_hf(model, prompts, args.output_len, args.hf_batch_size))
        _print(results[1])
        ratio = results[0].output_tokens_per_s / results[1].output_tokens_per_s
        print(f"kvflow / hf-transformers output throughput: {ratio:.2f}x "
              f"(dtype {llm.engine.core.dtype})")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0


def add_throughput_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("throughput", help="offline throughput on random prompts")
    p.add_argument("--num-prompts", type=int, default=64, help="random prompts to run")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens (EOS ignored)")
    p.add_argument("--compare", choices=["hf"], default=None,
                   help="also run HF transformers generate on the same prompts")
    p.add_argument("--hf-batch-size", type=int, default=64, help="HF static batch size")
    p.add_argument("--output-json", default=None, help="write the results here")
    add_lora_path_arg(p, "every request")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=_cmd_throughput)
