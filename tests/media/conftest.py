"""Hypothesis settings for the media property tests: no example database, no per-example
deadline (2 shared cores), and derandomized under CI so a CI run is reproducible (a
developer's runs keep exploring new inputs). Hypothesis still caches under .hypothesis/."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("mmfleet-media", database=None, deadline=None, derandomize=os.environ.get("CI") == "true",
                          print_blob=True)
settings.load_profile("mmfleet-media")
