"""Help: every setting, with its variable, default and description, appears in ``mmfleet
settings`` (from shared/settings.py), to which every ``--help`` points instead of repeating it;
the table in docs/guide/configuration.md is that same table. ``--version``; a bad value is a
clean exit."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from services.cli import _parser, main
from shared import settings as settings_mod
from shared import settings_doc
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
    docs = settings_doc.describe()
    assert [d.name for d in docs] == list(settings_mod.field_names())
    for d in docs:
        assert len(d.description) > 10, f"{d.name} has no real description"
        assert d.env == "MMFLEET_" + d.name.upper()


@pytest.mark.parametrize("argv", [[], *([c] for c in SUBCOMMANDS)], ids=lambda a: " ".join(a) or "mmfleet")
def test_help_points_to_the_settings_command(argv):
    text = squash(help_text(argv))
    assert "`mmfleet settings`" in text
    assert "MMFLEET_MEDIA_CACHE_BYTES" not in text  # the table lives in `mmfleet settings` alone
    if argv:
        assert "--config FILE" in text


def test_settings_command_lists_every_setting():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["settings"]) == 0
    text = squash(out.getvalue())
    for d in settings_doc.describe():
        assert f"{d.env} (default {d.default or chr(34) * 2})" in text, d.env
        assert squash(d.description) in text, d.env


def test_version():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and re.fullmatch(r"mmfleet \S+.*\n", out.getvalue())


def test_invalid_log_level_is_a_clean_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["worker", "--stages", "encode", "--log-level", "LOUD"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "mmfleet worker: " in err and "log_level must be DEBUG, INFO, WARNING or ERROR, not 'LOUD'" in err
    assert "Traceback" not in err


def test_settings_command_prints_the_same_table():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["settings"]) == 0
    assert out.getvalue().strip() == settings_doc.help_table().strip()


CONFIGURATION_PAGE = REPO / "docs" / "guide" / "configuration.md"


def test_configuration_page_table_is_generated_from_settings():
    page = CONFIGURATION_PAGE.read_text()
    m = re.search(r"<!-- settings-table:begin -->\n(.*?)\n<!-- settings-table:end -->", page, re.S)
    assert m, f"{CONFIGURATION_PAGE.relative_to(REPO)} lacks the generated settings table markers"
    assert m.group(1).strip() == settings_doc.markdown_table(), (
        f"the settings table in {CONFIGURATION_PAGE.relative_to(REPO)} is stale: replace it with the output "
        "of `mmfleet settings --markdown`")
    for d in settings_doc.describe():
        assert f"`{d.env}`" in page
