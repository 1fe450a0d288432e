"""Run a command and print its wall time and the CPU time of its whole process tree.

``/usr/bin/time`` counts a process and the children it waited for; a forkserver (and the
engine cores it forked and reaped) outlives pytest by a moment and is waited for by no one, so
its CPU is missed. This script makes itself a child subreaper (Linux ``prctl``), runs the
command, reaps every process reparented to it, then reads ``getrusage(RUSAGE_CHILDREN)``:

    python scripts/tree_cpu_time.py .venv/bin/python -m pytest -q tests/test_x.py

Prints one line on stderr, ``TREECPU rc=<status> wall=<s> cpu=<s> user=<s> sys=<s>``, and
exits with the command's status (docs/benchmarks.md, session 42).
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def main(argv: list[str]) -> int:
    """Run ``argv``; returns its exit status after printing the line above."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    start = time.monotonic()
    status = subprocess.Popen(argv).wait()
    wall = time.monotonic() - start
    while True:  # what was reparented here: a forkserver, multiprocessing's resource tracker
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"TREECPU rc={status} wall={wall:.1f} cpu={usage.ru_utime + usage.ru_stime:.1f} "
          f"user={usage.ru_utime:.1f} sys={usage.ru_stime:.1f}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
