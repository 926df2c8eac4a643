"""The installed mmfleet's version: what ``mmfleet --version`` prints and ``GET /version``
answers. Docs: docs/guide/api.md.
"""

from __future__ import annotations

import functools


@functools.cache
def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("mmfleet")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"
