"""Host time of one step's sampling metadata (``SamplingInputs.build``) with long
``allowed_token_ids``: 8 requests, each allowing 20,000 of 49,152 token ids (seeded, distinct),
every row sampling, the same rows step after step (a decode step). Times are medians of
``--steps`` calls (``time.perf_counter``), in microseconds.

Each tree is measured in its own process (``PYTHONPATH`` set to it): the current one, and a
baseline tree given with ``--baseline-tree`` (e.g. the commit before the change, exported with
``git archive <commit> kvflow | tar -x -C /tmp/allowed-base``). Both print a checksum of the
``allowed_token_ids`` tensors they build, which must match (same masks, same order).

    .venv/bin/python benchmarks/allowed_token_ids_host.py --baseline-tree /tmp/allowed-base

The current tree is also timed with its per-batch cache emptied before each call
(``rows changed``): the cost of a step whose rows differ from the previous step's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

VOCAB, NUM_ALLOWED, BATCH = 49_152, 20_000, 8


def _measure(steps: int, cold: bool) -> dict:
    import numpy as np
    import torch

    from kvflow.kv_cache_interface import FullAttentionSpec
    from kvflow.sampling_params import SamplingParams
    from kvflow.worker.input_batch import InputBatch
    from kvflow.worker.request_state import RequestState
    from kvflow.worker.sampling_inputs import SamplingInputs

    rng = np.random.default_rng(0)
    batch = InputBatch(BATCH, [FullAttentionSpec(16, 1, 8, torch.float32)])
    for i in range(BATCH):
        allowed = rng.choice(VOCAB, NUM_ALLOWED, replace=False).tolist()
        params = SamplingParams(temperature=0.8, allowed_token_ids=allowed, max_tokens=16)
        batch.add_request(RequestState(f"r{i}", [5, 6, 7], params, 2), [], ([i],), 3)
    inputs, rows = SamplingInputs(torch.device("cpu")), np.arange(BATCH)
    times = []
    for _ in range(steps + 3):  # 3 warm-up calls
        if cold:
            inputs._allowed_key = None  # as after a change of the batch's rows
        began = time.perf_counter()
        meta = inputs.build(batch, rows)
        times.append(time.perf_counter() - began)
    digest = hashlib.sha256()
    for tensor in meta.allowed_token_ids:
        digest.update(tensor.numpy().tobytes())
    return {"us": statistics.median(times[3:]) * 1e6, "checksum": digest.hexdigest()[:16]}


def _in_process(tree: str, steps: int, cold: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    cmd = [sys.executable, __file__, "--child", "--steps", str(steps)] + ["--cold"] * cold
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-tree", help="a kvflow source tree to compare with")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.steps, args.cold)))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    new = _in_process(here, args.steps, cold=False)
    cold = _in_process(here, args.steps, cold=True)
    print(f"batch {BATCH}, {NUM_ALLOWED} allowed ids each, vocab {VOCAB}: "
          f"SamplingInputs.build median over {args.steps} steps")
    print(f"  this tree, same rows:    {new['us']:10.1f} us  (checksum {new['checksum']})")
    print(f"  this tree, rows changed: {cold['us']:10.1f} us  (checksum {cold['checksum']})")
    if args.baseline_tree:
        base = _in_process(args.baseline_tree, args.steps, cold=False)
        print(f"  baseline tree:           {base['us']:10.1f} us  (checksum {base['checksum']})")
        print(f"  baseline / this tree: same rows {base['us'] / new['us']:.1f}x, "
              f"rows changed {base['us'] / cold['us']:.1f}x; identical masks: "
              f"{base['checksum'] == new['checksum'] == cold['checksum']}")


if __name__ == "__main__":
    main()
