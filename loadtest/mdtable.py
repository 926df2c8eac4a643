"""The header of a summary table with one column per run: the row names' columns (left-aligned),
then one right-aligned column per run, headed by its target and load label.

Design: docs/benchmarks/README.md.
"""

from __future__ import annotations


def runs_header(names: tuple[str, ...], runs: list[dict]) -> list[str]:
    """``names``: the headings of the leading columns; each run needs ``target`` and ``label``."""
    return ["| " + " | ".join([*names, *(f"`{r['target']}` {r['label']}" for r in runs)]) + " |",
            "|" + "---|" * len(names) + "---:|" * len(runs)]
