"""The docs check (in `make test`): over README.md and docs/, links and anchors resolve, the
`mmfleet` commands shown exist, the result tables match their records (loadtest.publish), and
no file holds a work diary; then the same checks shown to fail on a tree that breaks each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loadtest import publish
from tests.docs import checker
from tests.procs import REPO


def test_links_and_anchors_resolve():
    assert checker.broken_links(REPO) == []


def test_every_command_shown_exists():
    assert checker.unknown_commands(REPO) == []


def test_result_tables_match_their_records():
    assert publish.check(REPO) == [], "regenerate with `python -m loadtest.publish`"


def test_no_work_diary():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the files to check are git's")
    found = checker.diary_findings(REPO, checker.repo_files(REPO))
    assert not found, f"{len(found)} diary line(s):\n" + "\n".join(found)


# ------------------------------------------------------------ the checker, on a tree of its own

DAY = "-".join(("2000", "01", "01"))  # spelled apart: this file is under the diary check too
RECORD = {
    "id": "bench-demo", "title": "A demo run", "date": DAY, "commit": "abc1234",
    "machine": {"cores": 2, "cpu": "x86-64 (model not recorded)", "memory_gib": 24, "gpu": None},
    "command": "mmfleet bench suite", "conditions": "Nothing real.",
    "tables": [{"name": "ttft", "columns": ["target", "TTFT p50 (ms)"],
                "rows": [["fleet", "41 (40–45)"], ["inproc", 33]], "note": "A note."}],
    "plots": [{"table": "ttft", "kind": "bar", "x": "target", "y": ["TTFT p50 (ms)"]}],
}


def tree(tmp_path: Path, pages: dict[str, str], records: tuple[dict, ...] = (RECORD,)) -> Path:
    for name, text in {"README.md": "# Demo\n", **pages}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    results = tmp_path / "docs/benchmarks/results"
    results.mkdir(parents=True, exist_ok=True)
    for record in records:
        (results / f"{record['id']}.json").write_text(json.dumps(record))
    return tmp_path


def test_a_broken_link_fails(tmp_path):
    root = tree(tmp_path, {"docs/a.md": "# A\n\nSee [b](b.md), [c](../missing.md) and ![x](img/none.png).\n",
                           "docs/b.md": "# B\n"})
    assert [p.split(": ", 1)[0] for p in checker.broken_links(root)] == ["docs/a.md:3", "docs/a.md:3"]
    assert "../missing.md: no such file" in checker.broken_links(root)[0]


def test_a_broken_anchor_fails(tmp_path):
    page = ("# Engines and hops (tiny model): `mmfleet bench engines`\n\n## Notes\n\n## Notes\n\n"
            "Fine: [x](#engines-and-hops-tiny-model-mmfleet-bench-engines), [y](#notes-1), [z](b.md#here),\n"
            "[w](b.md#the-decode_core-and-its-cost), [v](../README.md#demo).\n\nBroken: [u](b.md#nowhere).\n")
    other = "# B\n\n<a id=\"here\"></a>\n## The `decode_core` and *its* cost\n"
    root = tree(tmp_path, {"docs/a.md": page, "docs/b.md": other})
    problems = checker.broken_links(root)
    assert len(problems) == 1 and problems[0].startswith("docs/a.md:10: b.md#nowhere: no anchor #nowhere"), problems


def test_links_inside_code_and_external_links_are_not_checked(tmp_path):
    page = "# A\n\n`[x](nope.md)`\n\n```md\n[y](nope.md)\n```\n\n[z](https://example.com/nope) <!-- [w](nope.md) -->\n"
    assert checker.broken_links(tree(tmp_path, {"docs/a.md": page})) == []


def test_an_unknown_command_fails(tmp_path):
    page = ("# A\n\nRun `mmfleet up --mode e-p-d`, `mmfleet keys hash`, `mmfleet bench kv --repeats 3`,\n"
            "`mmfleet <subcommand>`, `mmfleet worker: bad value` and `OMP_NUM_THREADS=1 python -m loadtest split`.\n\n"
            "```sh\nMMFLEET_DEMO_MODEL=qwen2-vl:bench mmfleet bench reuse   # fine\n"
            "echo key | mmfleet keys frob\nmmfleet foo --bar\n```\n\nAnd `python -m loadtest nosuch`.\n")
    problems = checker.unknown_commands(tree(tmp_path, {"docs/a.md": page}))
    assert [p.split(": `")[1].split("`")[0] for p in problems] == [
        "mmfleet keys frob", "mmfleet foo", "python -m loadtest nosuch"], problems
    assert problems[1].startswith("docs/a.md:9:") and "has: bench, doctor, gateway" in problems[1]


def test_a_stale_result_table_fails_until_published(tmp_path):
    page = "# A\n\n<!-- result: bench-demo/ttft -->\n| old | table |\n<!-- /result -->\n"
    root = tree(tmp_path, {"docs/benchmarks/a.md": page})
    assert publish.check(root) == [
        "docs/benchmarks/a.md:3: stale table bench-demo/ttft (run `python -m loadtest.publish`)"]
    assert publish.main(["--check", "--root", str(root)]) == 1
    assert publish.main(["--no-plots", "--root", str(root)]) == 0
    assert publish.check(root) == []
    text = (root / "docs/benchmarks/a.md").read_text()
    assert ("| target | TTFT p50 (ms) |\n|---|---|\n| fleet | 41 (40–45) |\n| inproc | 33 |\n\nSource: [bench-demo]"
            f"(results/bench-demo.json) · {DAY} · commit abc1234 · 2 cores, x86-64 (model not recorded), 24 GiB · "
            "`mmfleet bench suite`.\n\nA note.\n<!-- /result -->") in text
    assert checker.broken_links(root) == []  # the Source link resolves from the page's folder


def test_unknown_records_tables_and_bad_records_fail(tmp_path):
    bad = {**RECORD, "id": "bench-bad", "extra": 1, "tables": [{"name": "t", "columns": ["a", "b"], "rows": [["1"]]}]}
    del bad["commit"]
    page = ("# A\n\n<!-- result: bench-nope/ttft -->\n<!-- /result -->\n<!-- result: bench-demo/nope -->\n"
            "<!-- /result -->\n<!-- result: bench-demo/ttft -->\n\n```\n<!-- result: bench-nope/in-code -->\n```\n"
            "<!-- result: bench-demo/ttft -->\n<!-- result: bench-demo/ttft -->\n<!-- /result -->\n")
    problems = publish.check(tree(tmp_path, {"docs/a.md": page}, (RECORD, bad)))
    assert problems == [
        "docs/benchmarks/results/bench-bad.json: missing key 'commit'",
        "docs/benchmarks/results/bench-bad.json: unknown key 'extra' (allowed: id, title, date, commit, machine, "
        "command, conditions, tables, plots)",
        "docs/benchmarks/results/bench-bad.json: key 'tables[0].rows[0]': 1 cells for 2 columns",
        "docs/benchmarks/results/bench-bad.json: key 'plots[0].table': no table 'ttft' in this record",
        "docs/a.md:3: unknown record 'bench-nope' (no valid docs/benchmarks/results/bench-nope.json)",
        "docs/a.md:5: record 'bench-demo' has no table 'nope' (it has: ttft)",
        "docs/a.md:7: marker bench-demo/ttft has no <!-- /result --> after it",
        "docs/a.md:12: marker bench-demo/ttft has no <!-- /result --> after it",
        "docs/a.md:13: stale table bench-demo/ttft (run `python -m loadtest.publish`)"]


def test_a_record_whose_id_is_not_its_file_name_fails(tmp_path):
    root = tree(tmp_path, {}, ())
    (root / "docs/benchmarks/results/bench-other.json").write_text(json.dumps(RECORD))
    assert publish.check(root) == ["docs/benchmarks/results/bench-other.json: key 'id': 'bench-demo' is not the "
                                   "file's stem 'bench-other'"]


@pytest.mark.parametrize("kind", ["bar", "line", "stacked"])
def test_plots_are_drawn_the_same_every_time(tmp_path, kind):
    pytest.importorskip("matplotlib")
    record = {**RECORD, "plots": [{"table": "ttft", "kind": kind, "x": "target", "y": ["TTFT p50 (ms)"]}]}
    root = tree(tmp_path, {}, (record,))
    assert publish.publish(root, log=lambda _: None) == []
    png = root / "docs/benchmarks/plots/bench-demo-ttft.png"
    first = png.read_bytes()
    publish.publish(root, log=lambda _: None)
    assert png.read_bytes() == first and first.startswith(b"\x89PNG")


def test_diary_phrases_and_dates_are_found_but_for_the_exceptions(tmp_path):
    date = "20" + "26-11-27"
    lines = {
        "a.md": ["fine", "in the nin" + "th session", "(#" + "16)", "iss" + "ue 14", "the #" + "16 goals",
                 f"on {date}", "c=1 #1 is a repetition label", "multi-turn sessions of five turns"],
        "b.md": [f"Source: [bench-x](results/bench-x.json) · {date} · commit abc1234 · 2 cores · `x`."],
        "docs/benchmarks/results/bench-x.json": [f'{{"date": "{date}"}}'],
        "uv.lock": [f"# {date}"],
    }
    for name, text in lines.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("\n".join(text) + "\n")
    (tmp_path / "c.png").write_bytes(b"\x89PNG\0" + date.encode())
    (tmp_path / f"plot-{date}.png").write_bytes(b"\x89PNG\0")
    found = checker.diary_findings(tmp_path, sorted(lines) + ["c.png", f"plot-{date}.png"])
    assert [f.split(": ", 1)[0] for f in found] == [
        "a.md:2", "a.md:3", "a.md:4", "a.md:5", "a.md:6", f"plot-{date}.png"], found
