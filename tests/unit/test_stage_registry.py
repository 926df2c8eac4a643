"""The stage registry (services/stages.py) and what is derived from it: the modes' layouts, the
topics each worker consumes, the fleet's topics."""

from services.modes import MODES, entry_stages
from services.stages import BY_NAME, SPECS, STAGE_ORDER, fleet_topics
from shared.keys import INFRA_TOPICS
from shared.settings import Settings


def test_modes_derive_their_layouts_from_the_part_letters():
    assert MODES == {
        "epd": [("media-fetch", "encode", "prefill", "decode")],
        "e-pd": [("media-fetch", "encode"), ("prefill", "decode")],
        "e-p-d": [("media-fetch", "encode"), ("prefill",), ("decode",)],  # the encode worker fetches its media
        "ep-d": [("media-fetch", "encode", "prefill"), ("decode",)],
        "m-e-p-d": [("media-fetch",), ("encode",), ("prefill",), ("decode",)],
    }


def test_a_worker_consumes_only_where_work_enters_its_chain():
    assert entry_stages(("media-fetch", "encode", "prefill", "decode")) == ("media-fetch", "prefill")
    assert entry_stages(("encode",)) == ("encode",)
    assert entry_stages(("prefill", "decode")) == ("prefill",)
    assert entry_stages(("decode",)) == ("decode",)


def test_specs_are_consistent():
    topics = [s.topic for s in SPECS]
    assert len(set(topics)) == len(topics) and len(BY_NAME) == len(SPECS)
    assert STAGE_ORDER == ("media-fetch", "encode", "prefill", "decode")
    for spec in SPECS:
        assert spec.upstream is None or spec.upstream in BY_NAME, spec
        assert spec.part in "epd" and len(spec.part) == 1, spec
        unknown = [t for t in spec.produces if t not in topics and t not in INFRA_TOPICS]
        assert not unknown, (spec.name, unknown)
    assert set(fleet_topics(Settings())) >= set(topics) | set(INFRA_TOPICS)
    assert "mm.x-errors" in fleet_topics(Settings(ingress_fallback_reply_topic="mm.x-errors"))
