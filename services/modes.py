"""Deployment modes are configuration: which stages run together in one worker process.

``epd`` one worker does everything; ``e-pd`` media-fetch + encode, then prefill + decode;
``e-p-d`` media-fetch + encode, prefill, decode (the encode worker fetches its media: no Kafka
hop between them); ``ep-d`` all but decode together; ``m-e-p-d`` every stage apart. Stages and
their order come from ``services.stages``. Inside a worker, output for a local stage is handed
over in memory; a worker consumes only the topics where work enters its chain (``mm.prefill``
always). An engine lacking what a layout needs (KV export, KV import, generate) is refused at
start-up with :class:`UnsupportedLayout`. Design: docs/guide/modes-and-engines.md.
"""

from __future__ import annotations

from services.stages import BY_NAME, SPECS, STAGE_ORDER
from shared.engines.base import Capabilities


def _layout(mode: str) -> list[tuple[str, ...]]:
    """The worker groups of ``mode``: one group per ``-``-separated part of its name, holding the
    stages whose ``StageSpec.part`` letter is in it; ``m-e-p-d`` gives every stage its own worker."""
    if mode == "m-e-p-d":
        return [(s.name,) for s in SPECS]
    return [tuple(s.name for s in SPECS if s.part in group) for group in mode.split("-")]


MODES: dict[str, list[tuple[str, ...]]] = {m: _layout(m) for m in ("epd", "e-pd", "e-p-d", "ep-d", "m-e-p-d")}


class UnsupportedLayout(SystemExit):
    """A stage layout the chosen engine cannot serve; raised before any traffic is taken."""


def normalise(stages: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    unknown = [s for s in stages if s not in STAGE_ORDER]
    if unknown or not stages:
        raise UnsupportedLayout(f"unknown stage(s) {unknown or list(stages)}; choose from {', '.join(STAGE_ORDER)}")
    return tuple(s for s in STAGE_ORDER if s in stages)


def entry_stages(stages: tuple[str, ...]) -> tuple[str, ...]:
    """Stages whose topic this worker consumes."""
    return tuple(s for s in stages if BY_NAME[s].upstream not in stages)


def _missing(stages: tuple[str, ...], caps: Capabilities) -> tuple[str, str] | None:
    """(capability, what it is for) the layout needs and the engine lacks, or None."""
    if "prefill" in stages and "decode" in stages:
        need = ("generate", caps.generate, "prefill and decode together")
    elif "prefill" in stages:
        need = ("kv_export", caps.kv_export, "prefill apart from decode")
    elif "decode" in stages:
        need = ("kv_import", caps.kv_import, "decode apart from prefill")
    else:
        return None
    return None if need[1] else (need[0], need[2])


def supported_modes(caps: Capabilities) -> list[str]:
    return [m for m, layout in MODES.items() if all(_missing(stages, caps) is None for stages in layout)]


def parse_replicas(spec: str) -> dict[str, int]:
    """``"prefill=3,encode=2"`` -> ``{"prefill": 3, "encode": 2}`` (setting ``stage_replicas``)."""
    out: dict[str, int] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        stage, sep, count = part.partition("=")
        stage = stage.strip()
        if not sep or stage not in STAGE_ORDER or not count.strip().isdigit() or int(count) < 1:
            raise UnsupportedLayout(f"stage_replicas {spec!r}: expected stage=N,... with N >= 1 and stages from "
                                    f"{', '.join(STAGE_ORDER)}")
        out[stage] = int(count)
    return out


def group_replicas(stages: tuple[str, ...], replicas: dict[str, int]) -> int:
    """Worker processes for one stage group: the largest count asked for any of its stages."""
    return max([replicas.get(s, 1) for s in stages] + [1])


def check_engine(stages: tuple[str, ...], engine: str, caps: Capabilities) -> None:
    missing = _missing(stages, caps)
    if missing is not None:
        cap, what = missing
        raise UnsupportedLayout(
            f"engine {engine!r} cannot run {what}: it has no {cap} capability on this build; "
            f"modes it supports: {', '.join(supported_modes(caps))}")
