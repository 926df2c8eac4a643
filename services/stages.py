"""The stage registry: every stage of the fleet, in pipeline order. One line a stage.

Each stage declares itself once, in ``services/<stage>/spec.py`` (a :class:`shared.stage.StageSpec`:
topic, message, what it produces, its place in the modes, how to build its handler); the
worker, the modes, the supervisor, the autoscaler and the CLI derive what they need from here.

Design: docs/design/architecture.md.
"""

from __future__ import annotations

from services.decode.spec import SPEC as DECODE
from services.encode.spec import SPEC as ENCODE
from services.media_fetch.spec import SPEC as MEDIA_FETCH
from services.prefill.spec import SPEC as PREFILL
from shared.keys import INFRA_TOPICS
from shared.settings import Settings
from shared.stage import StageSpec

SPECS: tuple[StageSpec, ...] = (MEDIA_FETCH, ENCODE, PREFILL, DECODE)

BY_NAME: dict[str, StageSpec] = {s.name: s for s in SPECS}
STAGE_ORDER: tuple[str, ...] = tuple(s.name for s in SPECS)
STAGE_TOPICS: tuple[str, ...] = tuple(s.topic for s in SPECS)


def fleet_topics(settings: Settings) -> tuple[str, ...]:
    """Every topic the fleet needs: the stages', the infrastructure's, and a configured ingress
    fallback reply topic."""
    topics = STAGE_TOPICS + INFRA_TOPICS
    extra = settings.ingress_fallback_reply_topic
    return topics + ((extra,) if extra and extra not in topics else ())
