"""Help is complete: every setting, with its variable, default and description, appears in
``mmfleet --help``, each subcommand's ``--help`` and ``mmfleet settings``, all from
shared/settings.py; the README's configuration table is that same table."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from services.cli import _parser, main
from shared import settings as settings_mod
from tests.procs import REPO

SUBCOMMANDS = ("up", "worker", "gateway", "topics", "model", "settings")


def help_text(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as info:
        _parser().parse_args(argv + ["--help"])
    assert info.value.code == 0
    return out.getvalue()


def squash(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_every_setting_has_a_description():
    docs = settings_mod.describe()
    assert [d.name for d in docs] == list(settings_mod.field_names())
    for d in docs:
        assert len(d.description) > 10, f"{d.name} has no real description"
        assert d.env == "MMFLEET_" + d.name.upper()


@pytest.mark.parametrize("argv", [[], *([c] for c in SUBCOMMANDS)], ids=lambda a: " ".join(a) or "mmfleet")
def test_help_lists_every_setting(argv):
    text = squash(help_text(argv))
    for d in settings_mod.describe():
        assert f"{d.env} (default {d.default or chr(34) * 2})" in text, d.env
        assert squash(d.description) in text, d.env
    if argv:
        assert "--config FILE" in text


def test_settings_command_prints_the_same_table():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["settings"]) == 0
    assert out.getvalue().strip() == settings_mod.help_table().strip()


def test_readme_configuration_table_is_generated_from_settings():
    readme = (REPO / "README.md").read_text()
    m = re.search(r"<!-- settings-table:begin -->\n(.*?)\n<!-- settings-table:end -->", readme, re.S)
    assert m, "README lacks the generated settings table markers"
    assert m.group(1).strip() == settings_mod.markdown_table(), \
        "README settings table is stale: regenerate with `mmfleet settings --markdown`"
    for d in settings_mod.describe():
        assert f"`{d.env}`" in readme
