"""Memory growth with LoRA in the mix: resident memory (RSS) of every kvflow process, offline
or served (``--data-parallel-size 2`` too), over thousands of short requests that switch
adapters, load and unload them while requests use them, and end every way. Not a unit test
(tests/test_request_state_leaks.py walks the containers); this measures what a leak would
cost. ``benchmarks/rss_soak.py`` does the same without LoRA or a server.

Random PEFT adapters (rank 8 on q_proj and v_proj, written as peft writes them) are made for
the base model under ``--out``. Requests go in rounds of 10 of ``--prompt-len`` random words:

* offline (``LLMEngine``, ``--max-loras`` slots for ``--adapters`` adapters, so requests of a
  further adapter wait): 4 greedy on the adapters in turn and the base model, 2 sampled with
  n=2 and logprobs, a regex, a JSON schema, a stop string, one aborted after its first step;
  each round the dynamic adapter is unloaded after the first step with one of its requests
  still waiting, and loaded again under a fresh id (the server's way);
* served (``kvflow serve --lora-modules``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``): the same
  mix over HTTP (``model`` picks the adapter; ``/v1/completions`` and
  ``/v1/chat/completions``), a stream the client leaves after its first chunk, a request the
  client gives up on after 50 ms, and each round ``/v1/unload_lora_adapter`` +
  ``/v1/load_lora_adapter`` of the dynamic adapter while a request of it is in flight.

After ``--warmup`` requests, every ``--every`` requests: the RSS (VmRSS, /proc) of this
process (offline: after ``gc.collect()``, with the count and bytes of live torch tensors) or
of the server and each of its descendants (engine cores, DP coordinator, workers), and the
number of /metrics lines (label cardinality). Reported as one JSON line: per process the
first and last sample and the least-squares slope in MiB per 1000 requests.

Usage (docs/benchmarks.md):
    .venv/bin/python benchmarks/lora_soak.py --api offline
    .venv/bin/python benchmarks/lora_soak.py --api serve
    .venv/bin/python benchmarks/lora_soak.py --api serve --data-parallel-size 2
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import time
from pathlib import Path

from rss_soak import rss_mib, slope_per_1000

ROUND = 10
REGEX = "[ab]{3}"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="an HF folder (default: a tiny random Llama with the tokenizer of "
                   "--tokenizer-from, built under --out: per-request state, not the model, "
                   "is what is measured)")
    p.add_argument("--tokenizer-from", default="out/smollm2-hf")
    p.add_argument("--api", choices=["offline", "serve"], default="offline")
    p.add_argument("--data-parallel-size", type=int, default=1, help="served only")
    p.add_argument("--requests", type=int, default=2000, help="measured, after the warm-up")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--every", type=int, default=100, help="requests between samples")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--max-loras", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=12, help="words")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--out", default="/tmp/lora_soak")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_adapters(model: str, root: Path, count: int, seed: int) -> list[str]:
    """``count`` random rank-8 adapters of ``q_proj`` / ``v_proj``, in peft's format, under
    ``root``; returns their folders."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model) / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    rows = {"q_proj": config["num_attention_heads"] * head_dim,
            "v_proj": config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim}
    gen = torch.Generator().manual_seed(seed)
    folders = []
    for i in range(count):
        folder = root / f"adapter{i}"
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(layers):
            for module, out in rows.items():
                name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                tensors[f"{name}.lora_A.weight"] = 0.05 * torch.randn(8, hidden, generator=gen)
                tensors[f"{name}.lora_B.weight"] = 0.05 * torch.randn(out, 8, generator=gen)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16,
            "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, "bias": "none",
            "base_model_name_or_path": model}))
        folders.append(str(folder))
    return folders


def make_tiny_model(tokenizer_from: str, folder: Path) -> str:
    """A 2-layer random Llama (hidden 64) with the tokenizer of ``tokenizer_from``, saved in
    ``folder`` (once); returns the folder."""
    import shutil

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").exists():
        return str(folder)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    for extra in ("generation_config.json",):
        if (Path(tokenizer_from) / extra).exists():
            shutil.copy(Path(tokenizer_from) / extra, folder / extra)
    return str(folder)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(["red", "blue", "cat", "dog", "sun", "tree", "fish", "rock",
                                "bird", "lamp", "river", "stone"]) for _ in range(n))


# --- offline ---------------------------------------------------------------------------------

def live_tensors(torch) -> tuple[int, float]:
    """How many torch tensors are alive after ``gc.collect()``, and their MiB. The list is
    dropped before returning: a list kept until the next sample would keep the tensors that
    died meanwhile alive, and each sample's list its predecessor's (a growth of its own)."""
    gc.collect()
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    count, nbytes = len(tensors), sum(t.numel() * t.element_size() for t in tensors)
    del tensors
    return count, nbytes / 2**20


def offline(args: argparse.Namespace, adapters: list[str]) -> dict:
    """The offline soak through one LLMEngine; returns the report."""
    import torch

    from kvflow import SamplingParams
    from kvflow.config import EngineConfig
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.lora.request import LoRARequest
    from kvflow.structured import StructuredOutputsParams

    rng = random.Random(args.seed)
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=args.model, max_model_len=args.max_model_len, enable_lora=True,
        max_loras=args.max_loras, max_lora_rank=8))
    fixed = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters[:-1])]
    next_id = len(adapters) + 1
    dynamic = LoRARequest("dyn", next_id, adapters[-1])
    engine.core.add_lora(dynamic)
    mt = args.max_tokens
    greedy = SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True)
    kinds = [greedy] * 4 + [SamplingParams(temperature=1.0, n=2, logprobs=2, max_tokens=mt,
                                           seed=1)] * 2 + [
        SamplingParams(max_tokens=mt, structured_outputs=StructuredOutputsParams(regex=REGEX)),
        SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        SamplingParams(temperature=0, max_tokens=mt, stop=["a", "e", "o", " "]),
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)]  # aborted
    samples, total, done, start = [], args.warmup + args.requests, 0, time.perf_counter()
    while done <= total:
        if done >= args.warmup and (done - args.warmup) % args.every == 0:
            count, mib = live_tensors(torch)
            samples.append({"n": done - args.warmup, "rss": {"engine": rss_mib(os.getpid())},
                            "tensors": count, "tensor_mib": mib})
        if done == total:
            break
        rids = []
        for i, params in enumerate(kinds):
            lora = [*fixed, dynamic, None][(done // ROUND + i) % (len(fixed) + 2)]
            rids.append(engine.add_request(words(rng, args.prompt_len), params,
                                           lora_request=lora))
        engine.step()
        engine.abort_request(rids[-1])
        engine.core.remove_lora(dynamic.lora_int_id)  # its requests still run or wait
        next_id += 1
        dynamic = LoRARequest("dyn", next_id, dynamic.lora_path)
        engine.core.add_lora(dynamic)
        while engine.has_unfinished_requests():
            engine.step()
        done += ROUND
    return summary(args, samples, time.perf_counter() - start)


# --- served ----------------------------------------------------------------------------------

def process_tree(pid: int) -> dict[str, int]:
    """The server and its descendants: a label (name and pid) -> pid."""
    import psutil

    root = psutil.Process(pid)
    out = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        kind = "api" if proc.pid == pid else \
            "resource_tracker" if "resource_tracker" in cmd else proc.name()
        out[f"{kind}:{proc.pid}"] = proc.pid
    return out


async def served_round(client, url: str, rng: random.Random, args: argparse.Namespace,
                       names: list[str], failures: list[str], raced: list[int]) -> None:
    """One round of 10 requests over HTTP, concurrently, and the dynamic adapter unloaded and
    loaded again while one of its requests runs."""
    import httpx

    mt = args.max_tokens

    async def post(path: str, body: dict, timeout: float | None = 120.0) -> None:
        try:
            r = await client.post(f"{url}{path}", json=body, timeout=timeout)
            if r.status_code == 404 and body.get("model") == "dyn":
                raced.append(1)  # sent while the dynamic adapter was unloaded: vLLM's 404
            elif r.status_code != 200:
                failures.append(f"{path} {r.status_code} {r.text[:200]}")
        except httpx.TimeoutException:
            if timeout == 120.0:
                failures.append(f"{path} timed out")

    async def stream_left() -> None:
        body = {"model": names[0], "prompt": words(rng, args.prompt_len), "max_tokens": 64,
                "stream": True, "ignore_eos": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                 timeout=120.0) as r:
            async for _ in r.aiter_lines():
                break  # the client leaves after the first chunk

    async def switch() -> None:
        await asyncio.sleep(0.02)
        await post("/v1/unload_lora_adapter", {"lora_name": "dyn"})
        await post("/v1/load_lora_adapter", {"lora_name": "dyn", "lora_path": args.dyn_path})

    def comp(model: str, **extra) -> dict:
        return {"model": model, "prompt": words(rng, args.prompt_len), "max_tokens": mt,
                "temperature": 0, **extra}

    jobs = [post("/v1/completions", comp(names[i % len(names)])) for i in range(3)]
    jobs += [
        post("/v1/completions", comp("dyn", ignore_eos=True)),
        post("/v1/completions", comp(names[1], n=2, temperature=1.0, logprobs=2, seed=1)),
        post("/v1/chat/completions", {"model": names[2 % len(names)], "max_tokens": 8,
                                      "messages": [{"role": "user", "content": "hi"}],
                                      "response_format": {"type": "json_schema", "json_schema":
                                                          {"name": "a", "schema": SCHEMA}}}),
        post("/v1/completions", comp(names[0], guided_regex=REGEX)),
        post("/v1/completions", comp(args.base_name, stop=["a", "e"])),
        post("/v1/completions", comp(names[-1], max_tokens=64, ignore_eos=True),
             timeout=0.05),  # the client gives up
        stream_left(), switch()]
    await asyncio.gather(*jobs)


def served(args: argparse.Namespace, adapters: list[str]) -> dict:
    """The served soak; returns the report."""
    import sys

    import httpx

    sys.path.insert(0, str(Path(__file__).parent))
    from serve_harness import start_server, stop_server, wait_ready

    names = [f"a{i}" for i in range(len(adapters) - 1)]
    args.dyn_path, args.base_name = adapters[-1], "base"
    serve_args = [args.model, "--served-model-name", "base", "--max-model-len",
                  str(args.max_model_len), "--enable-lora", "--max-loras", str(args.max_loras),
                  "--max-lora-rank", "8", "--data-parallel-size", str(args.data_parallel_size),
                  "--lora-modules", *[f"{n}={p}" for n, p in zip(names, adapters)],
                  f"dyn={adapters[-1]}"]
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    proc, url = start_server(serve_args, Path(args.out) / "server.log", env)
    rng, failures, raced = random.Random(args.seed), [], []
    samples, total, done = [], args.warmup + args.requests, 0
    try:
        wait_ready(proc, url)
        start = time.perf_counter()

        async def run() -> None:
            nonlocal done
            limits = httpx.Limits(max_connections=32)
            async with httpx.AsyncClient(limits=limits) as client:
                while True:
                    if done >= args.warmup and (done - args.warmup) % args.every == 0:
                        metrics = (await client.get(f"{url}/metrics")).text
                        samples.append({"n": done - args.warmup,
                                        "rss": {k: rss_mib(p) for k, p in
                                                process_tree(proc.pid).items()},
                                        "metrics_lines": len(metrics.splitlines())})
                    if done >= total:
                        return
                    await served_round(client, url, rng, args, names, failures, raced)
                    done += ROUND

        asyncio.run(run())
        seconds = time.perf_counter() - start
    finally:
        stop_server(proc)
    out = summary(args, samples, seconds)
    out["failures"] = len(failures)
    out["dyn_404_during_reload"] = len(raced)
    out["first_failures"] = failures[:5]
    return out


def summary(args: argparse.Namespace, samples: list[dict], seconds: float) -> dict:
    xs = [s["n"] for s in samples]
    out = {"api": args.api, "data_parallel_size": args.data_parallel_size,
           "model": args.model, "requests": args.requests, "warmup": args.warmup,
           "seconds": round(seconds, 1), "processes": {}}
    for label in samples[0]["rss"]:
        ys = [s["rss"].get(label) for s in samples]
        if None in ys:
            continue
        out["processes"][label] = {"rss_mib_first_last": [round(ys[0], 1), round(ys[-1], 1)],
                                   "mib_per_1000": round(slope_per_1000(xs, ys), 2)}
    for key in ("tensors", "tensor_mib", "metrics_lines"):
        if key in samples[0]:
            out[f"{key}_first_last"] = [round(samples[0][key], 1), round(samples[-1][key], 1)]
    out["samples"] = samples
    return out


def main() -> None:
    args = parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        args.model = make_tiny_model(args.tokenizer_from, root / "tiny_llama")
    adapters = make_adapters(args.model, root / "adapters", args.adapters, args.seed)
    report = offline(args, adapters) if args.api == "offline" else served(args, adapters)
    (root / f"{args.api}_dp{args.data_parallel_size}.json").write_text(json.dumps(report))
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}))


if __name__ == "__main__":
    main()
