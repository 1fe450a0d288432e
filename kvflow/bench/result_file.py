"""vLLM's result-file flags of ``kvflow bench serve`` (``--save-result``, ``--result-dir``,
``--result-filename``): where the summary goes when ``--result-json`` is not given, named as
``vllm bench serve`` names it."""

from __future__ import annotations

import argparse
import math
import os
from datetime import datetime
from types import MappingProxyType

from kvflow.bench.checks import ensure_parent_dir

# vLLM's name (``--backend``) of the client that sends what kvflow's client sends on each
# ``--endpoint``: its default label (file names) and its result's ``backend``/``endpoint_type``
VLLM_BACKENDS = MappingProxyType({"completions": "openai", "chat": "openai-chat"})


def vllm_result_filename(label: str | None, request_rate: float, max_concurrency: int | None,
                         model: str, current_dt: str, backend: str = "openai") -> str:
    """vLLM's default result file name,
    ``{label}-{request_rate}qps[-concurrency{N}]-{last part of model}-{current_dt}.json``.

    Args:
        label: ``--label`` (None: ``backend``, as vLLM's default label is its ``--backend``).
        request_rate: requests per second as a float (``inf`` for all at once), written as
            Python prints it (``4.0``, ``inf``) as vLLM does.
        max_concurrency: ``--max-concurrency`` or None.
        model: the model name; only the part after its last ``/`` is used.
        current_dt: the local time as ``%Y%m%d-%H%M%S``.
        backend: vLLM's backend name of the endpoint (``VLLM_BACKENDS``).
    """
    concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    return (f"{label or backend}-{float(request_rate)}qps{concurrency}-"
            f"{model.split('/')[-1]}-{current_dt}.json")


def vllm_result_path(args: argparse.Namespace, now: datetime) -> str | None:
    """The file ``--save-result`` writes (None without it): ``--result-filename`` or vLLM's
    default name (``now`` gives its time; the label defaults to ``openai`` on the completions
    endpoint and ``openai-chat`` on the chat one, vLLM's backends of them), inside
    ``--result-dir`` when given."""
    if not args.save_result:
        return None
    rate = math.inf if args.request_rate is None else args.request_rate
    name = args.result_filename or vllm_result_filename(
        args.label, rate, args.max_concurrency, args.model, now.strftime("%Y%m%d-%H%M%S"),
        VLLM_BACKENDS[args.endpoint])
    return os.path.join(args.result_dir, name) if args.result_dir else name


def check_result_flags(args: argparse.Namespace) -> None:
    """Refuse combinations of the result-file flags that would write nothing or two files,
    and create ``--result-dir``.

    Raises:
        ValueError: naming the flags.
    """
    if not args.save_result:
        for flag, value in (("--result-dir", args.result_dir),
                            ("--result-filename", args.result_filename)):
            if value is not None:
                raise ValueError(f"{flag} names the file of --save-result, which is not given "
                                 "(vLLM writes nothing then); add --save-result, or use "
                                 "--result-json FILE")
        return
    if args.result_json:
        raise ValueError("give --result-json FILE or --save-result (vLLM's file naming), "
                         "not both")
    if args.sweep_rates:
        raise ValueError("--save-result names its file by --request-rate; with --sweep-rates "
                         "use --result-json FILE")
    ensure_parent_dir(os.path.join(args.result_dir or "", args.result_filename or "r.json"),
                      "--result-dir" if args.result_filename is None else "--result-filename")
