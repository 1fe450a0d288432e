"""This rank's torch profiler: ``start`` / ``stop`` around the steps to look at, one Chrome
trace per rank and run (vLLM's ``start_profile`` / ``stop_profile``; open the file in
Perfetto, https://ui.perfetto.dev, or chrome://tracing)."""

from __future__ import annotations

import os
import time

import torch

from kvflow.config.profiler import required_profiler_options


class RankProfiler:
    """One rank's ``torch.profiler.profile`` between :meth:`start` and :meth:`stop` (CPU
    activity, and CUDA's on a CUDA device)."""

    def __init__(self) -> None:
        self._profile: torch.profiler.profile | None = None
        self._path: str | None = None
        self._runs = 0  # numbers the traces: two runs within a second keep both

    def start(self, rank: int) -> None:
        """Start recording this rank's ops.

        Raises:
            ValueError: when ``KVFLOW_TORCH_PROFILER_DIR`` is unset (profiling off), its
                companion variables are bad, or a profile is already running.
        """
        options = required_profiler_options()
        if self._profile is not None:
            raise ValueError("a profile is already running: call stop_profile first")
        os.makedirs(options.trace_dir, exist_ok=True)
        self._runs += 1
        self._path = os.path.join(options.trace_dir, f"kvflow-rank{rank}-pid{os.getpid()}-"
                                  f"{time.strftime('%Y%m%d-%H%M%S')}-{self._runs}"
                                  ".pt.trace.json.gz")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities,
                                               record_shapes=options.record_shapes,
                                               with_stack=options.with_stack)
        self._profile.start()

    def stop(self) -> str:
        """Stop recording and write the trace (gzip-compressed Chrome trace JSON).

        Returns:
            The trace file's path.

        Raises:
            ValueError: when no profile is running.
        """
        if self._profile is None:
            raise ValueError("no profile is running: call start_profile first")
        profile, path = self._profile, self._path
        self._profile = self._path = None
        profile.stop()
        profile.export_chrome_trace(path)
        return path
