"""Where a fleet request's time to first token goes, from its spans and the client's clock.

Per request (spans' ``start_unix_ms``, ``claim_ms``, ``first_out_ms``; the client's
``sent_unix_ms`` and ``ttft_ms``; one wall clock) the TTFT is cut into parts that add up to it:
``gateway`` (POST → entry record produced), ``queue <stage>`` (produce → picked up), ``claims``
(the runner's Redis round trips), ``transfer`` (NIXL, media fetches), ``compute`` (up to the first
token), ``hand-offs`` (handler end → next produce: the residual) and ``stream read`` (token in
Redis → SSE chunk). ``inproc`` splits into its compute (media-fetch, encode, prefill spans) and
the rest, so ``fleet − inproc`` reads part by part. Design: docs/design/overhead.md.
"""

from __future__ import annotations

from loadtest.metrics import summarize

PARTS = ("gateway", "queue media-fetch", "queue encode", "queue prefill", "queue decode", "claims",
         "transfer", "compute", "hand-offs", "stream read")


def split_fleet(record: dict) -> dict[str, float] | None:
    spans, ttft, sent = record.get("spans") or [], record.get("ttft_ms"), record.get("sent_unix_ms")
    if not spans or ttft is None or not sent or not all(s.get("start_unix_ms") for s in spans):
        return None
    # the stage that wrote the first token (prefill in e-p-d / ep-d, else decode) ends the TTFT:
    # stages after it (decode's hop and KV pull) are not in it
    first = next((i for i, s in enumerate(spans) if s.get("first_out_ms")), None)
    if first is None:
        return None  # no stage said when it wrote the first token
    spans = spans[:first + 1]
    last = spans[-1]
    parts = dict.fromkeys(PARTS, 0.0)
    first_picked = spans[0]["start_unix_ms"] - spans[0].get("claim_ms", 0.0) - spans[0]["queue_ms"]
    parts["gateway"] = first_picked - sent
    for s in spans:
        key = f"queue {s['stage']}"
        if key in parts:
            parts[key] += s["queue_ms"]
        parts["claims"] += s.get("claim_ms", 0.0)
        parts["transfer"] += s["transfer_ms"]
    parts["compute"] = sum(s["total_ms"] - s["transfer_ms"] for s in spans[:-1]) \
        + max(last["first_out_ms"] - last["transfer_ms"], 0.0)
    first_token_unix = last["start_unix_ms"] + last["first_out_ms"]
    parts["stream read"] = sent + ttft - first_token_unix
    parts["hand-offs"] = ttft - sum(v for k, v in parts.items() if k != "hand-offs")
    return parts


def split_inproc(record: dict) -> dict[str, float] | None:
    spans, ttft = record.get("spans") or [], record.get("ttft_ms")
    if not spans or ttft is None:
        return None
    compute = sum(s["total_ms"] - s["transfer_ms"] for s in spans if s["stage"] != "decode")
    transfer = sum(s["transfer_ms"] for s in spans if s["stage"] != "decode")
    parts = dict.fromkeys(PARTS, 0.0)
    parts.update(compute=compute, transfer=transfer)
    parts["gateway"] = ttft - compute - transfer  # HTTP, template, SSE: what the fleet's ends do too
    return parts


def split_run(run: dict) -> dict | None:
    """``{part: {mean, p50, ...}}`` over the run's successful requests, plus ``n``; None when no
    request could be split (no spans, or an older protocol without the timestamps)."""
    split = split_inproc if run["target"].startswith("inproc") else split_fleet
    rows = [p for r in run["records"] if r.get("status") == 200 and (p := split(r)) is not None]
    if not rows:
        return None
    return {"n": len(rows), "parts": {k: summarize(p[k] for p in rows) for k in PARTS}}


def split_md(runs: list[dict]) -> list[str]:
    """A table per load level: each part's mean (p50) per target and fleet − inproc."""
    out: list[str] = []
    for label in dict.fromkeys(r["label"] for r in runs):
        at = {r["target"]: s for r in runs if r["label"] == label and (s := split_run(r)) is not None}
        if not any(not t.startswith("inproc") for t in at):
            continue
        targets = list(at)
        base = at.get("inproc")
        out += [f"### TTFT split at {label} (mean ms, p50 in brackets)", "",
                "| part | " + " | ".join(f"`{t}` (n={at[t]['n']})" for t in targets)
                + (" | fleet − inproc (mean) |" if base else " |"),
                "|---|" + "---:|" * (len(targets) + (1 if base else 0))]
        for part in (*PARTS, "TTFT"):
            def cell(s, part=part):
                if part == "TTFT":
                    return sum(v["mean"] for v in s["parts"].values()), None
                return s["parts"][part]["mean"], s["parts"][part]["p50"]
            cells = [cell(at[t]) for t in targets]
            row = [f"{m:.1f}" + (f" ({p:.1f})" if p is not None else "") for m, p in cells]
            if base:
                fleets = [m for t, (m, _) in zip(targets, cells, strict=True) if not t.startswith("inproc")]
                row.append(" / ".join(f"{m - cell(base)[0]:+.1f}" for m in fleets))
            out.append(f"| {'**TTFT**' if part == 'TTFT' else part} | " + " | ".join(row) + " |")
        out.append("")
    if out:
        out = ["## TTFT split", "", "Each fleet request's TTFT cut into parts that add up to it (see "
               "`loadtest/ttft_split.py`): gateway = POST → entry record produced; queue = produce → "
               "picked up; claims = the runner's Redis round trips; compute up to the first token; "
               "hand-offs = handler end → next produce; stream read = first token in Redis → SSE chunk. "
               "`inproc`: its compute and the rest (HTTP, template, SSE) under gateway.", ""] + out
    return out


def plot(runs: list[dict], out_dir, plt) -> list[str]:
    """One stacked bar per target and load level: the TTFT parts' means."""
    bars = [(f"{r['target']}\n{r['label']}", s) for r in runs if (s := split_run(r)) is not None]
    if not bars:
        return []
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(bars)), 4.5))
    bottoms = [0.0] * len(bars)
    for part in PARTS:
        vals = [max(s["parts"][part]["mean"], 0.0) for _, s in bars]
        ax.bar([b for b, _ in bars], vals, bottom=bottoms, label=part)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    ax.set(title="TTFT split (mean ms)", ylabel="ms")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out_dir / "ttft_split.png", dpi=110)
    plt.close(fig)
    return ["ttft_split.png"]
