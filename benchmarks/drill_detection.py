"""The README's alert drill (``kvscope up --drill``) on an idle and on a loaded machine, side by side.

Each run is a whole ``kvscope up --drill --no-dashboard --exit-when-done --json`` on the bundled
trace: the drill measures the replay's rate, sizes its rule and squeeze from it
(:mod:`kvscope.drill`), and reports when the page fired after the squeeze began
(``detection_seconds``) and when it resolved after the release (``resolve_seconds``). The
loaded run first starts ``--burners`` busy-loop processes (default: one per core), so the replay
competes for every core as it does on a shared, loaded machine; they are stopped by PID after.

Reported per run: the plan (window, baseline, floor, squeeze), detection and resolve seconds,
the failure (null when it paged and resolved), wall seconds and the load average before and
after; then ``detection_ratio`` (loaded / idle). One JSON object on stdout; progress on stderr.
Run it alone: it is the machine's load it measures.

``python -m benchmarks.drill_detection [--model NAME] [--burners N]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.parallel.group import free_port

BURN = "while True: pass"


def drill(model: str, data_dir: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "kvscope", "up", "--drill", "--no-dashboard", "--exit-when-done", "--json",
        "--model", model, "--data-dir", str(data_dir), "--agent-port", str(free_port()),
    ]  # fmt: skip
    load_before = os.getloadavg()
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    wall = time.monotonic() - started
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"failure": f"kvscope up exited {done.returncode} without a summary: {done.stderr[-2000:]}", "wall_seconds": wall}
    result = json.loads(lines[-1]).get("drill", {})
    print(next((line for line in done.stderr.splitlines() if line.startswith("drill: ") and "→" in line), ""), file=sys.stderr)
    return {
        **result,
        "exit_status": done.returncode,
        "wall_seconds": round(wall, 1),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="kvscope_hybrid-small", help="the README drill's model (default: %(default)s)")
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 2, help="busy-loop processes in the loaded run (default: one per core)")
    args = parser.parse_args()
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        print("idle run ...", file=sys.stderr)
        runs["idle"] = drill(args.model, Path(tmp) / "idle")
        print(f"loaded run with {args.burners} busy loops ...", file=sys.stderr)
        burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(args.burners)]
        try:
            time.sleep(5)  # the burners are running before the drill calibrates
            runs["loaded"] = drill(args.model, Path(tmp) / "loaded")
        finally:
            for proc in burners:
                proc.kill()
                proc.wait()
    idle, loaded = runs["idle"].get("detection_seconds"), runs["loaded"].get("detection_seconds")
    print(
        json.dumps(
            {
                "benchmark": "drill_detection",
                "model": args.model,
                "cpus": os.cpu_count(),
                "burners": args.burners,
                **runs,
                "detection_ratio": round(loaded / idle, 3) if idle and loaded else None,
                "both_paged_and_resolved": all(r.get("failure") is None and "detection_seconds" in r for r in runs.values()),
            }
        )
    )


if __name__ == "__main__":
    main()
