"""docs/guide/api.md's "Every request field" table names each field of the request schema
(services/gateway/schema.py, walked through its msgspec Structs at every depth), and nothing
else: a field added to the schema without saying what mmfleet does with it fails here."""

from __future__ import annotations

import re
import typing

from msgspec import Struct

from services.gateway import schema
from tests.procs import REPO

SECTION = "## Every request field"


def _structs_in(tp) -> tuple[type[Struct], ...]:
    if isinstance(tp, type) and issubclass(tp, Struct):
        return (tp,)
    return tuple(s for arg in typing.get_args(tp) for s in _structs_in(arg))


def schema_fields(struct: type[Struct], prefix: str = "") -> set[str]:
    """Dotted paths as the table writes them: ``messages[].content[].image_url.url``; a list of
    structs adds ``[]``; a content part's fields sit under ``content[]`` whatever its type."""
    out: set[str] = set()
    hints = typing.get_type_hints(struct)
    for name in struct.__struct_fields__:
        path = prefix + name
        out.add(path)
        inner = _structs_in(hints[name])
        listed = "list[" in str(hints[name]) and inner
        for sub in inner:
            out |= schema_fields(sub, f"{path}[]." if listed else f"{path}.")
    return out


def documented() -> set[str]:
    text = (REPO / "docs/guide/api.md").read_text()
    assert SECTION in text, f"docs/guide/api.md has no {SECTION!r} section"
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for line in body.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            names |= set(re.findall(r"`([a-z_\[\].]+)`", line.split("|")[1]))
    return names


def test_every_schema_field_is_in_the_table_and_only_those():
    fields = schema_fields(schema.ChatCompletionRequest) | schema_fields(schema.CompletionRequest)
    rows = documented()
    assert sorted(fields - rows) == [], "schema fields the table does not list"
    assert sorted(rows - fields - {"messages[].content[].type"}) == [], "table rows naming no schema field"


def test_the_walk_reaches_nested_parts():
    fields = schema_fields(schema.ChatCompletionRequest)
    assert {"messages[].content[].image_url.detail", "messages[].content[].video_embeds.second_per_grid_ts",
            "stream_options.include_usage", "messages[].role"} <= fields
