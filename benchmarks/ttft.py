"""Time to first token: cold, exact resume and Tail-Replay side by side (one JSON object).

The measurement lives in :mod:`kvscope.bench_ttft` so that ``kvscope bench ttft --json`` runs the
same code; see its docstring for what is measured.
"""

from kvscope.bench_ttft import main

if __name__ == "__main__":
    main()
