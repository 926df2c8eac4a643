"""What may be shown of settings: every setting's documentation, generated from
:class:`shared.settings.Settings` (its ``msgspec.Meta`` descriptions) for ``mmfleet --help``,
``mmfleet settings`` and the table in docs/guide/configuration.md (a test keeps that page equal
to :func:`markdown_table`); and the secret values of settings (:func:`secret_values`). Redaction
itself lives beside the settings (:func:`shared.settings.redacted`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_type_hints

import msgspec

from shared.settings import SECRET_FIELDS, Settings, _as_env, env_name, field_names


def secret_values(settings: Settings) -> list[str]:
    """The secret strings in ``settings`` (for scrubbing text that must never show them)."""
    found = [getattr(settings, n) for n in SECRET_FIELDS if getattr(settings, n)]
    userinfo = settings.redis_url.partition("://")[2].split("/", 1)[0].rpartition("@")[0]
    if ":" in userinfo:
        found.append(userinfo.split(":", 1)[1])
    return found


@dataclass(frozen=True)
class SettingDoc:
    name: str
    env: str  # the MMFLEET_ variable
    default: str  # as it would be written in the environment
    description: str


def describe() -> list[SettingDoc]:
    """Every setting with its variable, default and description, in declaration order."""
    hints = get_type_hints(Settings, include_extras=True)
    defaults = Settings()
    out = []
    for name in field_names():
        metas = [m for m in getattr(hints[name], "__metadata__", ()) if isinstance(m, msgspec.Meta)]
        text = next((m.description for m in metas if m.description), "")
        default = _as_env(getattr(defaults, name))
        if name == "cache_dir":
            default = "~/.cache/mmfleet"  # machine-dependent; the description says how it is found
        out.append(SettingDoc(name, env_name(name), default, text))
    return out


def help_table() -> str:
    """Plain-text table of every setting, for ``--help`` and ``mmfleet settings``."""
    lines = []
    for doc in describe():
        default = doc.default if doc.default != "" else '""'
        lines.append(f"  {doc.env}  (default {default})")
        lines.append(f"      {doc.description}")
    return "\n".join(lines)


def markdown_table() -> str:
    """The table in docs/guide/configuration.md (``mmfleet settings --markdown``; a test keeps the
    page equal to it)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for doc in describe():
        default = f"`{doc.default}`" if doc.default != "" else "(empty)"
        rows.append(f"| `{doc.env}` | {default} | {doc.description.replace('|', '/')} |")
    return "\n".join(rows)

