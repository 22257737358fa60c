"""The memory tier's step cost: each layout with `checkpoint.memory` off and on, alternating (`results/memory_tier.json`).

The runs are `bench/strategies.py --memory-cost` (its docstring has the
method); this script names them after their result file, and its
`memory_tier_table` is the table bench/README.md shows.

    make bench-memory        # or: python bench/memory_tier.py [--rounds N] [--steps N] [--only NAME ...]
                             # then: python bench/memory_tier.py --interleaved [--repeat N] [--steps N] (the in-run measure)
                             # and: python bench/memory_tier.py --interleaved --busy 2 --steps 120 (cores busy)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [str(Path(__file__).resolve().parent.parent)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from bench.strategies import main, memory_busy_markdown, memory_cost_markdown  # noqa: E402


def memory_tier_table(result: dict) -> str:
    return memory_cost_markdown(result)


def memory_busy_table(result: dict) -> str:
    return memory_busy_markdown(result)


if __name__ == "__main__":
    sys.exit(main(["--memory-cost", *sys.argv[1:]]))
