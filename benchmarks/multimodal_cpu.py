"""Vision-language cost on CPU: image preprocessing, vision-encoder time and TTFT for one
448 x 448 image, and the throughput of a mixed text/image workload through ``kvflow serve``.

The model is a tiny random-weight Qwen2-VL built here from a config with transformers (text:
hidden 64, 2 layers; vision: embed 32, depth 2, 14-pixel patches, 2 x 2 merge), unless
``--model`` names a Qwen2-VL folder. A 448 x 448 image is 32 x 32 patches = 1024 encoder rows
and 256 placeholder tokens.

Offline (one engine, prefix caching off so nothing but the encoder cache is reused), per round
and alternating inside the round:

* ``preprocess_ms``: the model's HF image processor (PIL backend) + placeholder expansion;
* ``encoder_ms``: one ``embed_multimodal`` call of the model (the ViT and merger) on it;
* TTFT (``RequestMetrics.ttft``, max_tokens=1) of three prompts of the same token count: text
  only (random token ids), a new image each round (encoded), and the same image every round
  after different text (an encoder-cache hit).

Serving (``--serve``): ``kvflow serve`` on the same folder, then ``kvflow bench serve
--endpoint chat --dataset random-image`` at each ``--image-fractions`` value (0 = text only),
the fractions alternated over ``--serve-repeats`` rounds; medians of output throughput and
TTFT. Figures go to stdout as JSON lines and a summary; ``--result-json`` keeps them.

    .venv/bin/python benchmarks/multimodal_cpu.py --rounds 15 --serve
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from serve_harness import bench_serve, start_server, stop_server, wait_ready

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' or 'image_url' in c %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in c %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a Qwen2-VL folder (default: build the tiny one)")
    p.add_argument("--image-size", default="448x448", help="WIDTHxHEIGHT")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--serve", action="store_true", help="also run the serving workload")
    p.add_argument("--image-fractions", default="0,0.5,1")
    p.add_argument("--serve-repeats", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--result-json", default=None)
    return p.parse_args(argv)


# ---- the tiny model -------------------------------------------------------------------------
def _tokenizer() -> Any:
    """A byte-level BPE of 512 tokens trained on a fixed corpus, plus the vision tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<eos>", "<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = ["the quick brown fox jumps over the lazy dog " * 4,
              "a paged KV cache holds the keys and values of every token " * 4,
              "what is in this picture? describe the image in detail " * 4] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>")
    fast.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_vl(folder: str) -> str:
    """Save a tiny random Qwen2-VL (fp32) with tokenizer and PIL image processor."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = _tokenizer()
    ids = tok.convert_tokens_to_ids(VISION_TOKENS)
    config = Qwen2VLConfig(
        text_config={"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "max_position_embeddings": 4096,
                     "rms_norm_eps": 1e-6, "eos_token_id": tok.eos_token_id,
                     "bos_token_id": tok.bos_token_id,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                         "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2,
                       "mlp_ratio": 2, "patch_size": 14, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "in_channels": 3},
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2],
        video_token_id=ids[3])
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).to(torch.float32).save_pretrained(folder)
    tok.save_pretrained(folder)
    Qwen2VLImageProcessorPil().save_pretrained(folder)
    return folder


def random_image(width: int, height: int, seed: int) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


# ---- offline: preprocessing, encoder, TTFT ---------------------------------------------------
class _Timer:
    """Appends wall-clock ms to ``times[name + "_ms"]`` and this thread's CPU ms (time other
    processes hold the core excluded) to ``times[name + "_cpu_ms"]``."""

    def __init__(self, times: dict[str, list[float]], name: str) -> None:
        self.times, self.name = times, name

    def __enter__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc: object) -> None:
        self.times[f"{self.name}_ms"].append((time.perf_counter() - self.wall) * 1e3)
        self.times[f"{self.name}_cpu_ms"].append((time.thread_time() - self.cpu) * 1e3)


def offline(args: argparse.Namespace, folder: str) -> dict[str, Any]:
    """Medians over ``--rounds`` of each quantity, the variants alternating in each round."""
    import torch

    from kvflow import LLM, SamplingParams

    width, height = (int(v) for v in args.image_size.split("x"))
    llm = LLM(folder, dtype="float32", enable_prefix_caching=False, num_kv_blocks=512,
              block_size=16)
    processor, model = llm.engine.processor, llm.engine.core.executor.runner.model
    one = SamplingParams(temperature=0, max_tokens=1)
    fixed = random_image(width, height, 0)
    expanded = processor.process({"prompt": f"x {PLACEHOLDER} y", "multi_modal_data":
                                  {"image": fixed}})
    feature = expanded.mm_features[0]
    num_tokens = len(expanded.token_ids)
    rng = np.random.default_rng(0)
    first_special = min(llm.engine.tokenizer.convert_tokens_to_ids(VISION_TOKENS))
    times: dict[str, list[float]] = {k: [] for k in (
        "preprocess_ms", "preprocess_cpu_ms", "encoder_ms", "encoder_cpu_ms", "ttft_text_ms",
        "ttft_new_image_ms", "ttft_cached_image_ms")}
    llm.generate({"prompt": f"warm {PLACEHOLDER}", "multi_modal_data": {"image": fixed}}, one)
    for r in range(args.rounds):
        image = random_image(width, height, 1000 + r)
        with _Timer(times, "preprocess"):
            processor.process({"prompt": f"x {PLACEHOLDER} y", "multi_modal_data":
                               {"image": image}})
        with torch.inference_mode(), _Timer(times, "encoder"):
            model.embed_multimodal([feature.pixel_values()], [tuple(feature.grid_thw)])
        text_ids = rng.integers(3, first_special, num_tokens).tolist()
        out = llm.generate({"prompt_token_ids": text_ids}, one, use_tqdm=False)[0]
        times["ttft_text_ms"].append(out.metrics.ttft * 1e3)
        out = llm.generate({"prompt": f"x {PLACEHOLDER} y", "multi_modal_data":
                            {"image": image}}, one, use_tqdm=False)[0]
        times["ttft_new_image_ms"].append(out.metrics.ttft * 1e3)
        out = llm.generate({"prompt": f"{'ab'[r % 2]} {PLACEHOLDER} y", "multi_modal_data":
                            {"image": fixed}}, one, use_tqdm=False)[0]
        times["ttft_cached_image_ms"].append(out.metrics.ttft * 1e3)
    summary = {k: statistics.median(v) for k, v in times.items()}
    summary.update(prompt_tokens=num_tokens, image_tokens=feature.length,
                   encoder_rows=feature.shape[0], image_size=args.image_size,
                   encoded=llm.engine.core.scheduler.encoder.num_encoded,
                   encoder_hits=llm.engine.core.scheduler.encoder.num_hits,
                   ttft_image_over_text=summary["ttft_new_image_ms"] / summary["ttft_text_ms"])
    return summary


# ---- serving: a mixed text/image workload ----------------------------------------------------
def serve(args: argparse.Namespace, folder: str, workdir: str) -> dict[str, Any]:
    """Output throughput and TTFT medians per image fraction (alternated across repeats)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    server, url = start_server([folder, "--dtype", "float32", "--num-kv-blocks", "1024",
                                "--block-size", "16", "--uvicorn-log-level", "warning"],
                               Path(workdir) / "server.log", env)
    try:
        wait_ready(server, url, timeout=300)
        fractions = [float(f) for f in args.image_fractions.split(",")]
        runs: dict[float, list[dict]] = {f: [] for f in fractions}
        for rep in range(args.serve_repeats):
            for f in fractions if rep % 2 == 0 else fractions[::-1]:
                runs[f].append(_bench_serve(url, folder, f, rep, workdir, args))
        return {str(f): _median_runs(rs) for f, rs in runs.items()}
    finally:
        stop_server(server)


def _bench_serve(url: str, folder: str, fraction: float, rep: int, workdir: str,
                 args: argparse.Namespace) -> dict[str, Any]:
    bench_args = ["--model", folder, "--endpoint", "chat", "--dataset", "random-image",
                  "--image-fraction", str(fraction), "--image-size", args.image_size,
                  "--num-prompts", str(args.num_prompts), "--input-len", "32",
                  "--output-len", "16", "--ignore-eos", "--seed", str(rep),
                  "--max-concurrency", "8"]
    return bench_serve(url, bench_args, Path(workdir) / f"serve_{fraction}_{rep}.json",
                       quiet=True)


def _median_runs(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = ("output_throughput", "request_throughput", "median_ttft_ms", "median_tpot_ms",
            "total_input_tokens")
    return {k: statistics.median(r[k] for r in runs) for k in keys} | \
        {"failed": sum(r["failed"] for r in runs), "num_images": runs[0]["num_images"]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="kvflow-mm-bench-") as workdir:
        folder = args.model or build_tiny_vl(os.path.join(workdir, "tiny_qwen2_vl"))
        result: dict[str, Any] = {"offline": offline(args, folder)}
        print(json.dumps({"offline": result["offline"]}))
        if args.serve:
            result["serve"] = serve(args, folder, workdir)
            print(json.dumps({"serve": result["serve"]}))
    result["load_average"] = os.getloadavg()
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=1)
    off = result["offline"]
    print(f"preprocess {off['preprocess_ms']:.2f} ms (CPU {off['preprocess_cpu_ms']:.2f}), "
          f"encoder {off['encoder_ms']:.2f} ms (CPU {off['encoder_cpu_ms']:.2f}; "
          f"{off['encoder_rows']} rows -> {off['image_tokens']} tokens); TTFT text "
          f"{off['ttft_text_ms']:.2f} ms, new image {off['ttft_new_image_ms']:.2f} ms "
          f"({off['ttft_image_over_text']:.2f}x), cached image "
          f"{off['ttft_cached_image_ms']:.2f} ms ({off['prompt_tokens']} prompt tokens)")


if __name__ == "__main__":
    main()
