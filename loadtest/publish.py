"""Benchmark records to docs: ``python -m loadtest.publish [--check] [--no-plots]``.

Reads every ``docs/benchmarks/results/<id>.json`` record, fills each marker pair
``<!-- result: ID/TABLE -->`` … ``<!-- /result -->`` in README.md and docs/**/*.md with that
table and its source line, and draws the records' plots to ``docs/benchmarks/plots/ID-TABLE.png``
(matplotlib, the ``bench`` extra). ``--check`` writes nothing and exits 1 listing every stale
marker, unknown record or table and record that fails the schema. Record schema, markers and
plots: docs/benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path("docs/benchmarks/results")
PLOTS = Path("docs/benchmarks/plots")

KEYS = ("id", "title", "date", "commit", "machine", "command", "conditions", "tables")
OPTIONAL = ("plots",)
MACHINE_KEYS = ("cores", "cpu", "memory_gib", "gpu")
PLOT_KINDS = ("bar", "line", "stacked")
ID_RE = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
NAME_RE = re.compile(r"[A-Za-z0-9_]+(?:-[A-Za-z0-9_]+)*")
DATE_RE = re.compile(r"\d{4}-\d{2}-\d{2}")
COMMIT_RE = re.compile(r"[0-9a-f]{7,40}|unknown")
OPEN_RE = re.compile(r"<!--\s*result:\s*(\S+?)/(\S+?)\s*-->")
CLOSE_RE = re.compile(r"<!--\s*/result\s*-->")
FENCE_RE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
NUMBER_RE = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _is_cell(value) -> bool:
    return isinstance(value, str) or (isinstance(value, (int, float)) and not isinstance(value, bool))


def validate(record, stem: str) -> list[str]:
    """What is wrong with one record (empty: nothing), each naming the key."""
    if not isinstance(record, dict):
        return ["not a JSON object"]
    errors = [f"missing key '{k}'" for k in KEYS if k not in record]
    errors += [f"unknown key '{k}' (allowed: {', '.join(KEYS + OPTIONAL)})"
               for k in record if k not in KEYS + OPTIONAL]
    if "id" in record and record["id"] != stem:
        errors.append(f"key 'id': {record['id']!r} is not the file's stem {stem!r}")
    if not ID_RE.fullmatch(stem):
        errors.append("file name: an id is lowercase letters and digits joined by dashes")
    for key in ("title", "command", "conditions"):
        if key in record and not (isinstance(record[key], str) and record[key].strip()):
            errors.append(f"key '{key}': a non-empty string")
    if "date" in record and not (isinstance(record["date"], str) and DATE_RE.fullmatch(record["date"])):
        errors.append("key 'date': YYYY-MM-DD")
    if "commit" in record and not (isinstance(record["commit"], str) and COMMIT_RE.fullmatch(record["commit"])):
        errors.append("key 'commit': a hex commit hash (7-40 digits) or 'unknown'")
    errors += _machine_errors(record)
    table_errors, columns = _table_errors(record)
    return errors + table_errors + _plot_errors(record, columns)


def _machine_errors(record: dict) -> list[str]:
    errors: list[str] = []
    machine = record.get("machine")
    if "machine" in record:
        if not isinstance(machine, dict):
            errors.append("key 'machine': an object with " + ", ".join(MACHINE_KEYS))
        else:
            errors += [f"key 'machine.{k}': missing" for k in MACHINE_KEYS if k not in machine]
            errors += [f"key 'machine.{k}': unknown" for k in machine if k not in MACHINE_KEYS]
            if machine.get("cores") is not None and not (isinstance(machine["cores"], int) and machine["cores"] > 0):
                errors.append("key 'machine.cores': a positive integer or null")
            if machine.get("memory_gib") is not None and not (
                    isinstance(machine["memory_gib"], (int, float)) and machine["memory_gib"] > 0):
                errors.append("key 'machine.memory_gib': a positive number or null")
            for k in ("cpu", "gpu"):
                if machine.get(k) is not None and not isinstance(machine[k], str):
                    errors.append(f"key 'machine.{k}': a string or null")
    return errors


def _table_errors(record: dict) -> tuple[list[str], dict[str, list]]:
    """The tables' errors, and the columns of each well-named table (for the plots' checks)."""
    errors: list[str] = []
    tables = record.get("tables")
    columns: dict[str, list] = {}
    if "tables" in record:
        if not isinstance(tables, list) or not tables:
            errors.append("key 'tables': a non-empty list")
            tables = []
        for i, table in enumerate(tables):
            where = f"key 'tables[{i}]"
            if not isinstance(table, dict):
                errors.append(f"{where}': an object")
                continue
            errors += [f"{where}.{k}': missing" for k in ("name", "columns", "rows") if k not in table]
            errors += [f"{where}.{k}': unknown" for k in table if k not in ("name", "columns", "rows", "note")]
            name = table.get("name")
            if not (isinstance(name, str) and NAME_RE.fullmatch(name)):
                errors.append(f"{where}.name': letters, digits, '_' and '-'")
            elif name in columns:
                errors.append(f"{where}.name': {name!r} twice")
            cols = table.get("columns")
            if not (isinstance(cols, list) and cols and all(isinstance(c, str) for c in cols)):
                errors.append(f"{where}.columns': a non-empty list of strings")
                cols = None
            if isinstance(name, str) and cols:
                columns[name] = cols
            rows = table.get("rows")
            if not isinstance(rows, list):
                errors.append(f"{where}.rows': a list of rows")
                rows = []
            for j, row in enumerate(rows):
                if not (isinstance(row, list) and all(_is_cell(c) for c in row)):
                    errors.append(f"{where}.rows[{j}]': a list of strings and numbers")
                elif cols and len(row) != len(cols):
                    errors.append(f"{where}.rows[{j}]': {len(row)} cells for {len(cols)} columns")
            if "note" in table and not isinstance(table["note"], str):
                errors.append(f"{where}.note': a string")
    return errors, columns


def _plot_errors(record: dict, columns: dict[str, list]) -> list[str]:
    errors: list[str] = []
    plots = record.get("plots", [])
    if not isinstance(plots, list):
        return ["key 'plots': a list"]
    for i, plot in enumerate(plots):
        where = f"key 'plots[{i}]"
        if not isinstance(plot, dict):
            errors.append(f"{where}': an object")
            continue
        allowed = ("table", "kind", "x", "y", "title", "ylabel", "exclude", "log")
        errors += [f"{where}.{k}': missing" for k in ("table", "kind", "x", "y") if k not in plot]
        errors += [f"{where}.{k}': unknown" for k in plot if k not in allowed]
        if plot.get("kind") not in PLOT_KINDS:
            errors.append(f"{where}.kind': one of {', '.join(PLOT_KINDS)}")
        if plot.get("table") in [q.get("table") for q in plots[:i] if isinstance(q, dict)]:
            errors.append(f"{where}.table': a second plot of {plot.get('table')!r} (one plot per table)")
        cols = columns.get(plot.get("table"))
        if cols is None:
            errors.append(f"{where}.table': no table {plot.get('table')!r} in this record")
            continue
        ys = plot.get("y")
        if not (isinstance(ys, list) and ys):
            errors.append(f"{where}.y': a non-empty list of column names")
            ys = []
        for col in [plot.get("x"), *ys]:
            if col not in cols:
                errors.append(f"{where}': no column {col!r} in table {plot['table']!r}")
    return errors


def load_records(root: Path = ROOT) -> tuple[dict[str, dict], list[str]]:
    """Every valid record by id, and the problems of the others (each naming its file)."""
    records, problems = {}, []
    for path in sorted((root / RESULTS).glob("*.json")):
        rel = path.relative_to(root).as_posix()
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            problems.append(f"{rel}: not readable JSON: {exc}")
            continue
        errors = validate(record, path.stem)
        problems += [f"{rel}: {e}" for e in errors]
        if not errors:
            records[path.stem] = record
    return records, problems


def _cell(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def machine_text(machine: dict) -> str:
    parts = []
    if machine.get("cores"):
        parts.append(f"{machine['cores']} cores")
    if machine.get("cpu"):
        parts.append(machine["cpu"])
    if machine.get("memory_gib"):
        parts.append(f"{_cell(machine['memory_gib'])} GiB")
    if machine.get("gpu"):
        parts.append(machine["gpu"])
    return ", ".join(parts) or "machine not recorded"


def render(record: dict, table_name: str, page: Path, root: Path = ROOT) -> str:
    """The lines between one marker pair, for ``page`` (its link to the record is relative)."""
    table = next(t for t in record["tables"] if t["name"] == table_name)
    lines = ["| " + " | ".join(_cell(c) for c in table["columns"]) + " |",
             "|" + "---|" * len(table["columns"])]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in table["rows"]]
    link = os.path.relpath(root / RESULTS / f"{record['id']}.json", page.parent).replace(os.sep, "/")
    command = f"`{record['command']}`" if "`" not in record["command"] else f"`` {record['command']} ``"
    lines += ["", f"Source: [{record['id']}]({link}) · {record['date']} · commit {record['commit']} · "
                  f"{machine_text(record['machine'])} · {command}."]
    if table.get("note"):
        lines += ["", table["note"]]
    return "\n".join(lines)


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    found = [root / "README.md"] if (root / "README.md").is_file() else []
    return found + sorted(p for p in (root / "docs").rglob("*.md") if p.is_file())


def fill(text: str, page: Path, records: dict[str, dict], root: Path = ROOT) -> tuple[str, list[str], list[str]]:
    """``text`` with every marker pair filled, what could not be filled (unknown record or table,
    a pair left open) and which pairs held another text. Markers count only on a line of their
    own, outside code blocks."""
    lines = text.split("\n")
    out, problems, stale, fence, i = [], [], [], None, 0
    rel = page.relative_to(root).as_posix() if page.is_relative_to(root) else str(page)
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        m = FENCE_RE.match(line)
        if m:
            mark = m.group(1)
            if fence is None:
                fence = mark
            elif mark[0] == fence[0] and len(mark) >= len(fence) and not line.strip()[len(mark):].strip():
                fence = None
            continue
        opened = OPEN_RE.fullmatch(line.strip()) if fence is None else None
        if not opened:
            continue
        rid, tname = opened.groups()
        end = next((j for j in range(i, len(lines)) if CLOSE_RE.fullmatch(lines[j].strip())
                    or OPEN_RE.fullmatch(lines[j].strip())), None)
        if end is None or not CLOSE_RE.fullmatch(lines[end].strip()):
            problems.append(f"{rel}:{i}: marker {rid}/{tname} has no <!-- /result --> after it")
            continue
        record = records.get(rid)
        if record is None:
            problems.append(f"{rel}:{i}: unknown record {rid!r} (no valid {RESULTS.as_posix()}/{rid}.json)")
            out += lines[i:end]
        elif not any(t["name"] == tname for t in record["tables"]):
            names = ", ".join(t["name"] for t in record["tables"])
            problems.append(f"{rel}:{i}: record {rid!r} has no table {tname!r} (it has: {names})")
            out += lines[i:end]
        else:
            rendered = render(record, tname, page, root).split("\n")
            if rendered != lines[i:end]:
                stale.append(f"{rel}:{i}: stale table {rid}/{tname}")
            out += rendered
        out.append(lines[end])
        i = end + 1
    return "\n".join(out), problems, stale


def _number(cell) -> float:
    if isinstance(cell, (int, float)):
        return float(cell)
    m = NUMBER_RE.search(cell.replace("\u2212", "-"))
    return float(m.group(0)) if m else math.nan


def _plain(text) -> str:
    """A cell or column name without Markdown's code and emphasis marks (for a plot's labels)."""
    return re.sub(r"`|\*\*", "", str(text))


def draw(record: dict, plot: dict, path: Path) -> None:
    """One plot of one table: ``x`` labels the categories, ``y`` the series (numbers are read from
    the start of each cell); ``stacked`` stacks the rows in one bar per ``y`` column."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    table = next(t for t in record["tables"] if t["name"] == plot["table"])
    xi = table["columns"].index(plot["x"])
    rows = [r for r in table["rows"] if str(r[xi]) not in plot.get("exclude", [])]
    labels = [_plain(r[xi]) for r in rows]
    series = {_plain(y): [_number(r[table["columns"].index(y)]) for r in rows] for y in plot["y"]}
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if plot["kind"] == "line":
        for name, values in series.items():
            ax.plot(labels, values, marker="o", label=name)
    elif plot["kind"] == "bar":
        width = 0.8 / len(series)
        for k, (name, values) in enumerate(series.items()):
            ax.bar([x + (k - (len(series) - 1) / 2) * width for x in range(len(labels))], values, width, label=name)
        ax.set_xticks(range(len(labels)), labels, rotation=20 if max(map(len, labels), default=0) > 12 else 0,
                      ha="right" if max(map(len, labels), default=0) > 12 else "center")
    else:
        names = list(series)
        bottom_pos, bottom_neg = [0.0] * len(names), [0.0] * len(names)
        for j, label in enumerate(labels):
            values = [0.0 if math.isnan(series[n][j]) else series[n][j] for n in names]
            bottoms = [bp if v >= 0 else bn for v, bp, bn in zip(values, bottom_pos, bottom_neg)]
            ax.bar(names, values, 0.6, bottom=bottoms, label=label)
            bottom_pos = [bp + max(v, 0) for v, bp in zip(values, bottom_pos)]
            bottom_neg = [bn + min(v, 0) for v, bn in zip(values, bottom_neg)]
    if plot.get("log"):
        ax.set_yscale("log")
    ax.set_title(_plain(plot.get("title") or record["title"]), fontsize=11)
    ax.set_ylabel(_plain(plot.get("ylabel") or (plot["y"][0] if len(plot["y"]) == 1 else "")))
    if plot["kind"] != "stacked":
        ax.set_xlabel(_plain(plot["x"]))
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)


def plot_path(record: dict, plot: dict, root: Path = ROOT) -> Path:
    return root / PLOTS / f"{record['id']}-{plot['table']}.png"


def check(root: Path = ROOT) -> list[str]:
    """Every problem ``--check`` reports: records failing the schema, unknown records or tables,
    open marker pairs and pages whose tables differ from their records."""
    records, problems = load_records(root)
    for page in pages(root):
        text = page.read_text(encoding="utf-8")
        _, found, stale = fill(text, page, records, root)
        problems += found + [f"{s} (run `python -m loadtest.publish`)" for s in stale]
    return problems


def publish(root: Path = ROOT, plots: bool = True, log=print) -> list[str]:
    """Rewrite the pages' tables and draw the plots; returns the problems (nothing is written for
    a marker that names an unknown record or table)."""
    records, problems = load_records(root)
    for page in pages(root):
        text = page.read_text(encoding="utf-8")
        new, found, _ = fill(text, page, records, root)
        problems += found
        if new != text:
            page.write_text(new, encoding="utf-8")
            log(f"updated {page.relative_to(root).as_posix()}")
    wanted = [(r, p) for r in records.values() for p in r.get("plots", [])]
    if wanted and plots:
        try:
            importlib.import_module("matplotlib")
        except ImportError:
            plots = False
            log("matplotlib is not installed (pip install -e '.[bench]'): plots skipped")
    elif wanted:
        log("--no-plots: plots skipped")
    if plots:
        for record, plot in wanted:
            path = plot_path(record, plot, root)
            draw(record, plot, path)
            log(f"drew {path.relative_to(root).as_posix()}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.publish", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if anything is stale or wrong")
    p.add_argument("--no-plots", action="store_true", help="do not draw the plots")
    p.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    root = args.root.resolve()
    problems = check(root) if args.check else publish(root, plots=not args.no_plots)
    for problem in problems:
        print(problem, file=sys.stderr)
    if args.check and not problems:
        print("benchmark records and result tables are up to date")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
