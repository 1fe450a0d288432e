"""Host time of EAGLE's feature stash per decode step: ``EagleDrafter.observe_target`` (the
target's hidden states of the step kept for the head) and the stash reads of the head's
passes (``EagleDrafter._features``), on SmolLM2-135M (out/smollm2-hf, float32, CPU) with a
random one-layer EAGLE head saved by this script, ``--batch`` greedy requests drafting
``--k`` tokens every step (``adaptive: false``). Times are medians over the decode steps
(every scheduled row a decode), in microseconds (``time.perf_counter``).

Each tree is measured in its own process (``PYTHONPATH`` set to it): the current one, and a
baseline tree given with ``--baseline-tree`` (e.g. the commit before the change, exported with
``git archive <commit> kvflow | tar -x -C /tmp/eagle-base``). Both print a checksum of the
generated tokens, which must match (greedy output does not depend on the stash).

    .venv/bin/python benchmarks/eagle_stash_host.py --baseline-tree /tmp/eagle-base \
        --cpu-threads 1

On shared cores, two threads' OpenMP barriers stall for milliseconds now and then (a
descheduled thread): ``--cpu-threads 1`` measures the host work itself. ``--micro`` times
``observe_target`` alone on a stand-in batch (no model, caches not flushed by a forward pass
between calls), one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TARGET = "out/smollm2-hf"


def _save_head(folder: str) -> None:
    """A random EAGLE-1 head (fc [H, 2H] + bias, one Llama layer) for the target."""
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(TARGET, "config.json")) as f:
        config = json.load(f)
    config.update(num_hidden_layers=1, architectures=["EagleLlamaForCausalLM"])
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv, d = config["num_attention_heads"], config["num_key_value_heads"], \
        config["head_dim"]
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    tensors = {"fc.weight": rand(h, 2 * h), "fc.bias": rand(h),
               "layers.0.self_attn.q_proj.weight": rand(heads * d, h),
               "layers.0.self_attn.k_proj.weight": rand(kv * d, h),
               "layers.0.self_attn.v_proj.weight": rand(kv * d, h),
               "layers.0.self_attn.o_proj.weight": rand(h, heads * d),
               "layers.0.mlp.gate_proj.weight": rand(inter, h),
               "layers.0.mlp.up_proj.weight": rand(inter, h),
               "layers.0.mlp.down_proj.weight": rand(h, inter),
               "layers.0.post_attention_layernorm.weight": torch.ones(h)}
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def _measure(batch: int, k: int, max_tokens: int, cpu_threads: int | None) -> dict:
    import hashlib

    from kvflow import LLM, SamplingParams
    from kvflow.spec_decode.eagle import EagleDrafter

    times: dict[str, list[float]] = {"observe_target": [], "features": []}
    step_features = [0.0]
    observe, features = EagleDrafter.observe_target, EagleDrafter._features

    def timed_observe(self, b, inputs, *args, **kwargs):
        rows = inputs.rows
        decode = bool(((b.num_tokens[rows] - b.num_computed_tokens[rows]) == 1).all())
        started = time.perf_counter()
        out = observe(self, b, inputs, *args, **kwargs)
        if decode:
            times["observe_target"].append(time.perf_counter() - started)
            times["features"].append(step_features[0])
        step_features[0] = 0.0
        return out

    def timed_features(self, *args, **kwargs):
        started = time.perf_counter()
        out = features(self, *args, **kwargs)
        step_features[0] += time.perf_counter() - started
        return out

    EagleDrafter.observe_target, EagleDrafter._features = timed_observe, timed_features
    with tempfile.TemporaryDirectory() as head:
        _save_head(head)
        llm = LLM(model=TARGET, dtype="float32", max_num_seqs=batch, cpu_threads=cpu_threads,
                  kv_cache_memory=512 << 20,
                  speculative_config={"method": "eagle", "model": head,
                                      "num_speculative_tokens": k, "adaptive": False})
        prompts = [f"Request {i}: write a short story about a lighthouse keeper number {i}."
                   for i in range(batch)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    ignore_eos=True), use_tqdm=False)
    digest = hashlib.sha256(json.dumps([o.outputs[0].token_ids for o in outs]).encode())
    return {"steps": len(times["observe_target"]),
            "observe_target_us": statistics.median(times["observe_target"]) * 1e6,
            "features_us": statistics.median(times["features"]) * 1e6,
            "checksum": digest.hexdigest()[:16]}


def _micro(batch: int, k: int, hidden_size: int = 576) -> dict:
    """``observe_target`` alone on a stand-in batch (no model, no forward pass between
    calls): ``batch`` rows each verifying ``k`` drafts, the stash read up to each row's
    computed tokens before each call (as the mirror pass does); median of 250 calls after 50,
    one thread."""
    import types

    import numpy as np
    import torch

    from kvflow.spec_decode import eagle

    torch.set_num_threads(1)
    ids = [f"r{i}" for i in range(batch)]
    b = types.SimpleNamespace(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                              num_computed_tokens=np.full(batch, 100, np.int64),
                              num_tokens=np.full(batch, 101, np.int64),
                              pending_sample=np.full(batch, -1, np.int64), version=1,
                              num_reqs=batch)
    inputs = types.SimpleNamespace(rows=np.arange(batch, dtype=np.int64),
                                   query_start=np.arange(batch + 1, dtype=np.int64) * (k + 1))
    hidden = torch.randn(batch * (k + 1), hidden_size)
    drafter = eagle.EagleDrafter.__new__(eagle.EagleDrafter)
    new = "capacity" in eagle.FeatureStash.__init__.__code__.co_varnames
    drafter.stash = eagle.FeatureStash(k + 1) if new else eagle.FeatureStash()
    drafter._slot_cache = None
    times = []
    for step in range(300):
        b.num_computed_tokens += 1
        b.num_tokens += 1
        if new and step:
            slots = np.array([drafter.stash.slot[r] for r in ids])
            drafter.stash.drop_before(slots, b.num_computed_tokens)
        elif not new and step:
            for i, r in enumerate(ids):
                drafter.stash.drop_before(r, int(b.num_computed_tokens[i]))
        started = time.perf_counter()
        if new:
            drafter.observe_target(b, inputs, hidden, 4, None)
        else:
            drafter.observe_target(b, inputs, hidden)
        times.append(time.perf_counter() - started)
    return {"rows": batch, "observe_target_us": statistics.median(times[50:]) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--cpu-threads", type=int, help="the engine's (default: its own)")
    parser.add_argument("--baseline-tree", help="a tree holding the baseline's kvflow/")
    parser.add_argument("--micro", action="store_true",
                        help="observe_target alone on a stand-in batch (no model)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_micro(args.batch, args.k) if args.micro else
                         _measure(args.batch, args.k, args.max_tokens, args.cpu_threads)))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = [("this tree", here)] + ([("baseline", args.baseline_tree)]
                                     if args.baseline_tree else [])
    for name, tree in trees:
        env = dict(os.environ, PYTHONPATH=tree)
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                              "--batch", str(args.batch), "--k", str(args.k),
                              "--max-tokens", str(args.max_tokens)] +
                             (["--cpu-threads", str(args.cpu_threads)]
                              if args.cpu_threads else []) + (["--micro"] if args.micro else []),
                             env=env, cwd=here, check=True, capture_output=True, text=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:10s} ({tree}): {result}")


if __name__ == "__main__":
    main()
