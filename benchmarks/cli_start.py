"""Start-up time of the command line: the operators' commands (no torch) against one that imports
torch, side by side in one run (issue 24).

Each command is a fresh process from the repository root, ``sys.executable -m kvscope ...``;
the commands are interleaved, one round after another, so that load on this shared machine falls
on all of them alike. Reported per command: the median wall seconds over ``--runs`` rounds, the
ratio to ``python -c "import torch"``, and whether the command imported torch at all (one extra
untimed run under ``-X importtime``). ``python -c pass`` is the interpreter's own floor.

Prints one JSON object: ``{"runs", "median_seconds": {command: s}, "ratio_to_import_torch":
{command: r}, "imports_torch": {command: bool}, "load_average_before", "load_average_after"}``;
progress on stderr. No time is asserted anywhere (absolute times on a shared machine are
context).

``python -m benchmarks.cli_start [--runs 5]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KVSCOPE = [sys.executable, "-m", "kvscope"]
COMMANDS: dict[str, list[str]] = {
    "kvscope --help": [*KVSCOPE, "--help"],
    "kvscope sql --help": [*KVSCOPE, "sql", "--help"],
    "kvscope alerts check alerts/default_rules.yaml": [*KVSCOPE, "alerts", "check", "alerts/default_rules.yaml"],
    "kvscope replay --help": [*KVSCOPE, "replay", "--help"],
    'python -c "import torch"': [sys.executable, "-c", "import torch"],
    "python -c pass": [sys.executable, "-c", "pass"],
}
"""What is timed: name → argv (run from the repository root)."""
TORCH = 'python -c "import torch"'


def wall_seconds(argv: list[str]) -> float:
    """One run of ``argv``, output discarded; raises ``CalledProcessError`` if it fails."""
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def imports_torch(argv: list[str]) -> bool:
    """Whether ``argv`` (a Python command line) imports the top-level ``torch`` module."""
    done = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], cwd=ROOT, check=True, capture_output=True, text=True)
    return any(line.startswith("import time:") and line.rsplit("|", 1)[-1].strip() == "torch" for line in done.stderr.splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=5, help="timed rounds; the median is reported (default: %(default)s)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    for argv in COMMANDS.values():  # warm the OS page cache: the first run reads every .py and .so
        wall_seconds(argv)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for i in range(args.runs):
        for name, argv in COMMANDS.items():
            times[name].append(wall_seconds(argv))
        print(f"round {i + 1}/{args.runs}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()), file=sys.stderr)
    median = {name: statistics.median(t) for name, t in times.items()}
    doc = {
        "runs": args.runs,
        "median_seconds": median,
        "ratio_to_import_torch": {name: m / median[TORCH] for name, m in median.items()},
        "imports_torch": {name: imports_torch(argv) for name, argv in COMMANDS.items()},
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
