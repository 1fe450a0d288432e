"""Write tests/file_costs.txt (the per-file seconds by which ``pytest -n 2`` hands out the
costliest test files first, tests/file_order.py) from a run's durations report.

    .venv/bin/python -m pytest -q -n 2 --durations=0 --durations-min=0 > run.log
    .venv/bin/python scripts/file_costs.py run.log > tests/file_costs.txt

Reads pytest's ``--durations`` lines (``1.23s setup tests/x.py::test_y``), sums the set-up,
call and teardown seconds of each file's tests and prints ``seconds path`` lines, costliest
first. Several logs may be given: a file's cost is then its mean over the logs that list it.
Exit status 2 (and a message naming the file) when a log holds no durations line.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s+(setup|call|teardown)\s+(\S+)")


def file_seconds(text: str) -> dict[str, float]:
    """{test file: seconds of its set-up, call and teardown phases} from one durations
    report (a phase listed twice, as when a rerun adds its lines, counts once)."""
    seen: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        match = DURATION.match(line)
        if match:
            seen[(match.group(3), match.group(2))] = float(match.group(1))
    costs: dict[str, float] = defaultdict(float)
    for (nodeid, _phase), seconds in seen.items():
        costs[nodeid.split("::", 1)[0]] += seconds
    return dict(costs)


def main(paths: list[str]) -> int:
    """Print the table for the logs at ``paths``; returns the exit status."""
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    runs = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as log:
            costs = file_seconds(log.read())
        if not costs:
            print(f"{path}: no '--durations' lines (run pytest with --durations=0 "
                  "--durations-min=0)", file=sys.stderr)
            return 2
        runs.append(costs)
    names = {name for run in runs for name in run}
    mean = {name: sum(run[name] for run in runs if name in run) /
            sum(name in run for run in runs) for name in names}
    print("# seconds path: set-up + calls + teardown of each test file, written by "
          "scripts/file_costs.py")
    for name in sorted(mean, key=lambda n: (-mean[n], n)):
        print(f"{mean[name]:.1f} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
