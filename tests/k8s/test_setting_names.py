"""Every ``MMFLEET_*`` variable that compose/ and deploy/ name (in a value, a key or a comment) is
a setting the code reads under that name now: an old name (``MMFLEET_MODEL_PATH``, still read
for existing deployments, serves a real model under the demo model's name) or a removed one
would start pods that do not do what the file says."""

from __future__ import annotations

import re
from pathlib import Path

from shared import settings as settings_mod

REPO = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bMMFLEET_[A-Z0-9]+(?:_[A-Z0-9]+)*\b")


def named(text: str) -> set[str]:
    return set(NAME.findall(text))


def files() -> list[Path]:
    return sorted(p for top in ("compose", "deploy") for p in (REPO / top).rglob("*") if p.is_file())


def test_every_setting_the_deployment_files_name_is_one_the_code_reads():
    known = {settings_mod.env_name(n) for n in settings_mod.field_names()} | {settings_mod.CONFIG_ENV}
    seen, unknown = set(), {}
    for path in files():
        for name in named(path.read_text(errors="replace")):
            seen.add(name)
            if name not in known:
                unknown.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert not unknown, f"settings the code does not read under these names: {unknown}"
    assert {"MMFLEET_MODEL", "MMFLEET_DEVICE", "MMFLEET_TOPIC_PARTITIONS", "MMFLEET_GATEWAY_PORT"} <= seen


def test_an_old_name_is_caught():
    assert named("- {name: MMFLEET_MODEL_PATH, value: /models/served}  # MMFLEET_* settings") == \
        {"MMFLEET_MODEL_PATH"}
    known = {settings_mod.env_name(n) for n in settings_mod.field_names()}
    assert "MMFLEET_MODEL_PATH" not in known
