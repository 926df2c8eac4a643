"""The decode stage (apart from prefill): its topic, its message and how a worker builds its
handler. With prefill in the same worker the prefill stage generates (``services.prefill.generate``)
and this stage is not consumed at all.

Design: docs/design/architecture.md.
"""

from __future__ import annotations

from shared import protocol
from shared.keys import TOPIC_DECODE
from shared.stage import StageBuild, StageParts, StageSpec


async def build(parts: StageParts) -> StageBuild | None:
    if "prefill" in parts.stages:  # prefill generates (services.prefill.generate)
        return None
    from services.decode.handler import DecodeHandler

    return StageBuild(DecodeHandler(await parts.engine(parts.settings.engine)),
                      concurrency=parts.settings.decode_concurrency)


SPEC = StageSpec(name="decode", topic=TOPIC_DECODE, message=protocol.DecodeRequest, produces=(), part="d",
                 build=build, upstream="prefill")
