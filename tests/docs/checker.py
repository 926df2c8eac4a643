"""The docs check: relative links and anchors in README.md and docs/**/*.md resolve, every
`mmfleet` (and `python -m loadtest`) command they show exists, and no file holds a work diary.
Every function takes the repository root, so the tests can point it at a temporary tree."""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import unicodedata
from pathlib import Path
from urllib.parse import unquote

from loadtest.publish import pages

FENCE_RE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX_RE = re.compile(r"^ {0,3}#{1,6}(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT_RE = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
ID_ATTR_RE = re.compile(r"<[a-zA-Z][^>]*?\s(?:id|name)\s*=\s*[\"']([^\"']+)[\"']")
INLINE_LINK_RE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>\n]*>|[^\s()]+(?:\([^\s()]*\)[^\s()]*)*)"
                            r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REF_DEF_RE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>\n]*>|\S+)", re.M)
HTML_LINK_RE = re.compile(r"<(?:a|img|source)\b[^>]*?\s(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", re.I)
COMMENT_RE = re.compile(r"<!--.*?-->", re.S)
SCHEME_RE = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")
CODE_SPAN_RE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")
PLACEHOLDER_RE = re.compile(r"[<>\[\]{}$|\"'…*]|^\.\.\.$|[:,]$")  # a placeholder, or output ("mmfleet up: ...")
SEPARATORS_RE = re.compile(r"&&|\|\||[|;]|\$\(")


# ---------------------------------------------------------------- Markdown structure

def _blank(text: str) -> str:
    """Spaces for every character but newlines (keeps offsets and line numbers)."""
    return re.sub(r"[^\n]", " ", text)


def split_code(text: str, spans: bool = True) -> tuple[str, list[tuple[int, str]]]:
    """The text with fenced blocks, HTML comments and (``spans``) code spans blanked out, and the
    code itself as (line number, snippet): each fenced block's lines and each code span."""
    lines, snippets, fence = text.split("\n"), [], None
    for n, line in enumerate(lines, 1):
        m = FENCE_RE.match(line)
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip().strip(fence[0]):
                fence = None
            else:
                snippets.append((n, line))
            lines[n - 1] = _blank(line)
        elif m:
            fence = m.group(1)
            lines[n - 1] = _blank(line)
    prose = "\n".join(lines)
    prose = COMMENT_RE.sub(lambda m: _blank(m.group(0)), prose)
    if not spans:
        return prose, snippets
    out, offset = [], 0
    for para in re.split(r"(\n[ \t]*\n)", prose):
        def span(m: re.Match) -> str:
            start = offset + m.start()
            snippets.append((prose.count("\n", 0, start) + 1, m.group(2).strip()))
            return _blank(m.group(0))
        out.append(CODE_SPAN_RE.sub(span, para))
        offset += len(para)
    return "".join(out), snippets


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's Markdown text: its rendered text, lower-cased, without
    punctuation and symbols (but '-' and '_'), each space a '-'."""
    text = re.sub(r"<[^>]+>", "", heading)
    text = re.sub(r"!\[([^\]]*)\]\([^)]*\)", "", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"\*+|~~|`+|(?<!\w)_+|_+(?!\w)", "", text).strip().lower()
    kept = (c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return "".join(kept).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page offers: its headings' slugs (a repeated one gets -1, -2, ...) and the
    ids and names of its HTML elements."""
    lines = split_code(text, spans=False)[0].split("\n")
    found, seen = set(), {}
    for i, line in enumerate(lines):
        m = ATX_RE.match(line)
        title = m.group(1) or "" if m else None
        if title is None and i + 1 < len(lines) and SETEXT_RE.match(lines[i + 1]) and line.strip() \
                and not re.match(r"^ {0,3}([|>*+-]|#|\d+[.)]\s|<)", line) and not SETEXT_RE.match(line):
            title = line.strip()
        if title is None:
            continue
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    found.update(ID_ATTR_RE.findall(COMMENT_RE.sub("", text)))
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link and image outside code: inline, reference
    definitions and HTML href / src."""
    prose, _ = split_code(text)
    found = []
    for regex in (INLINE_LINK_RE, REF_DEF_RE, HTML_LINK_RE):
        for m in regex.finditer(prose):
            found.append((prose.count("\n", 0, m.start()) + 1, m.group(1).strip("<>")))
    return sorted(found)


# ---------------------------------------------------------------- the checks

def broken_links(root: Path) -> list[str]:
    """Each relative link or anchor in README.md and docs/**/*.md that does not resolve.
    External links (a scheme, or //host) are not fetched."""
    root = root.resolve()
    cache: dict[Path, set[str]] = {}
    problems = []
    for page in pages(root):
        rel = page.relative_to(root).as_posix()
        for line, target in links(page.read_text(encoding="utf-8")):
            if not target or SCHEME_RE.match(target):
                continue
            path, _, anchor = target.partition("#")
            path = unquote(path)
            dest = page if not path else (root / path.lstrip("/") if path.startswith("/") else page.parent / path)
            dest = Path(os.path.normpath(dest))
            if not dest.is_relative_to(root):
                problems.append(f"{rel}:{line}: {target}: outside the repository")
                continue
            if not dest.exists():
                problems.append(f"{rel}:{line}: {target}: no such file")
                continue
            if not anchor:
                continue
            if dest.is_dir():
                dest = dest / "README.md"
            if dest.suffix.lower() != ".md" or not dest.is_file():
                continue  # anchors into code (#L10) or folders without a README are not checked
            if dest not in cache:
                cache[dest] = anchors(dest.read_text(encoding="utf-8"))
            if unquote(anchor) not in cache[dest]:
                problems.append(f"{rel}:{line}: {target}: no anchor #{anchor} in {dest.relative_to(root).as_posix()}")
    return problems


def _tree(parser: argparse.ArgumentParser) -> dict:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {name: _tree(sub) for name, sub in action.choices.items()}
    return {}


@functools.cache
def command_trees() -> dict[str, dict]:
    """The real parsers' subcommands, nested: ``mmfleet`` (services/cli.py, with ``bench`` the
    harness's own parser) and ``loadtest`` (``python -m loadtest``, loadtest/cli.py)."""
    from loadtest.cli import _parser as loadtest_parser
    from services.cli import _parser as mmfleet_parser

    bench = _tree(loadtest_parser())
    mmfleet = _tree(mmfleet_parser())
    mmfleet["bench"] = bench
    return {"mmfleet": mmfleet, "loadtest": bench}


def commands(snippet: str) -> list[tuple[str, list[str]]]:
    """(program, its words) for each `mmfleet ...` or `python -m loadtest ...` in a snippet."""
    found = []
    for line in snippet.split("\n"):
        for part in SEPARATORS_RE.split(line):
            words = part.split()
            if words and words[0] == "$":
                words = words[1:]
            while words and ENV_RE.match(words[0]):
                words = words[1:]
            if words and (words[0] == "mmfleet" or words[0].endswith("/mmfleet")):
                found.append(("mmfleet", words[1:]))
            elif len(words) > 2 and re.fullmatch(r"(?:\S*/)?python(?:3(?:\.\d+)?)?", words[0]) \
                    and words[1:3] == ["-m", "loadtest"]:
                found.append(("loadtest", words[3:]))
    return found


def unknown_commands(root: Path, trees: dict | None = None) -> list[str]:
    """Each command shown in the docs' code whose subcommand the real parser does not have."""
    trees = trees or command_trees()
    root = root.resolve()
    problems = []
    for page in pages(root):
        rel = page.relative_to(root).as_posix()
        for line, snippet in split_code(page.read_text(encoding="utf-8"))[1]:
            for program, words in commands(snippet):
                node, said = trees[program], [program if program == "mmfleet" else "python -m loadtest"]
                for word in words:
                    if not node or word.startswith("-") or PLACEHOLDER_RE.search(word):
                        break
                    if word not in node:
                        problems.append(f"{rel}:{line}: `{' '.join(said + [word])}`: no such command "
                                        f"(`{' '.join(said)}` has: {', '.join(sorted(node))})")
                        break
                    said.append(word)
                    node = node[word]
    return problems


# ---------------------------------------------------------------- no work diary

_ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth"
DIARY = [re.compile(p, re.I) for p in (
    rf"\b(?:{_ORDINALS}|\d+(?:st|nd|rd|th))\s+sessions?\b",   # a numbered work session
    r"\bsessions?\s+of\s+20\d\d",                              # a session of a date
    r"\b(?:this|last|next|previous|earlier)\s+sessions?\b",     # sessions of work
    r"\bissues?\s+#?\d+",                                       # an issue's number
    r"#\d{1,4}(?:'s)?\s+(?:goals?|targets?)\b",                 # an issue's goals
    r"\((?:see\s+)?#\d{1,4}\)",                                 # a number in brackets
    r"\b(?:of|in|by|from|since|see|for|per)\s+#\d{1,4}\b",      # a number after "of", "in", ...
)]
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# The exceptions, all of them: benchmark records hold their run's date (and are not read at all);
# in a page, the Source line that `python -m loadtest.publish` writes under a record's table names
# its date; lock files pin by date where they pin at all.
EXEMPT_FILES = ("docs/benchmarks/results/*.json",)
DATED_FILES = ("*.lock", "package-lock.json")
DATED_LINE = re.compile(r"^Source: \[[a-z0-9-]+\]\([^)\s]*results/[a-z0-9-]+\.json\) · 20\d\d-\d\d-\d\d · commit ")


def repo_files(root: Path) -> list[str]:
    """The files git tracks, and those it would track (untracked, not ignored), that exist."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (root / f).is_file() and not (root / f).is_symlink()})


def diary_findings(root: Path, files: list[str]) -> list[str]:
    """Each file among ``files`` (relative to ``root``) named by a date, and each line of the text
    ones with a diary phrase or a dated work period, but for the exceptions above."""
    problems = []
    for name in files:
        path = Path(name)
        if any(path.match(p) for p in EXEMPT_FILES):
            continue
        if DATE.search(name):
            problems.append(f"{name}: a dated file name")
        try:
            data = (root / name).read_bytes()
            text = data.decode("utf-8") if b"\0" not in data else None
        except (OSError, UnicodeDecodeError):
            text = None
        if text is None:
            continue  # binary
        dates_ok = any(path.match(p) for p in DATED_FILES)
        for n, line in enumerate(text.split("\n"), 1):
            hits = [m.group(0) for regex in DIARY for m in regex.finditer(line)]
            if not dates_ok and not DATED_LINE.match(line):
                hits += DATE.findall(line)
            if hits:
                problems.append(f"{name}:{n}: {', '.join(repr(h) for h in hits)}: {line.strip()[:120]}")
    return problems
