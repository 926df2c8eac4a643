"""Client-named media parts (``uuid``) and ``cache_salt`` at the gateway, without a fleet: the
part forms vLLM takes (url null or "" with a uuid), their checks by name, the cache scope a
request gets from its key and salt, and the KV block hashes that scope seeds."""

from __future__ import annotations

import json

import pytest

from services.gateway.frontend import Frontend
from services.gateway.media_names import MAX_SALT_CHARS, MAX_UUID_CHARS, MediaNames, cache_scope, item_key
from services.gateway.prompt import MediaInput, PromptBuilder
from services.gateway.responses import Rejected
from shared.kv.blocks import block_hashes
from shared.settings import Settings
from tests.e2e.test_skeleton import noise_image, png_data_url

MODEL = "mmfleet-demo"


@pytest.fixture(scope="module")
def front(model_dir):
    s = Settings()
    return Frontend(s, PromptBuilder.for_model(model_dir, s), None, None, None, None, None)


def chat(parts: list[dict], **top) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": parts}],
                       **top}).encode()


def refusal(front, body: bytes, *, is_chat: bool = True):
    with pytest.raises(Rejected) as info:
        front.prepare(body, chat=is_chat)
    return info.value.event


TEXT = {"type": "text", "text": "What is this?"}


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": None, "uuid": "cat-1"},
    {"type": "image_url", "uuid": "cat-1"},
    {"type": "image_url", "image_url": {"url": ""}, "uuid": "cat-1"},
], ids=["null", "absent", "empty-url"])
def test_a_uuid_alone_is_an_item_without_data(front, part):
    prepared, _ = front.prepare(chat([part, TEXT]), chat=True)
    (item,) = prepared.media
    assert (item.kind, item.uuid, item.url, item.data) == ("image", "cat-1", "", None)
    assert item.param == "messages[0].content[0]"


def test_a_uuid_with_data_names_that_data(front):
    url = png_data_url(noise_image(1))
    prepared, _ = front.prepare(chat([{"type": "image_url", "image_url": {"url": url}, "uuid": "cat-1"}, TEXT]),
                                chat=True)
    (item,) = prepared.media
    assert item.uuid == "cat-1" and item.data is not None


def test_bad_uuids_and_parts_without_data_or_name_are_refused_by_name(front):
    ev = refusal(front, chat([{"type": "image_url", "image_url": None, "uuid": ""}, TEXT]))
    assert (ev.status, ev.param) == (400, "messages[0].content[0].uuid")
    ev = refusal(front, chat([{"type": "image_url", "image_url": None, "uuid": "x" * (MAX_UUID_CHARS + 1)}, TEXT]))
    assert (ev.status, ev.param) == (400, "messages[0].content[0].uuid")
    ev = refusal(front, chat([{"type": "image_url", "image_url": None}, TEXT]))  # neither data nor a name
    assert (ev.status, ev.param) == (400, "messages[0].content[0]")
    ev = refusal(front, chat([{"type": "image_url", "image_url": None, "uuid": "a", "name": "b"}, TEXT]))
    assert (ev.status, ev.param, ev.code) == (400, "messages[0].content[0].name", "unsupported_parameter")


@pytest.mark.parametrize("is_chat", [True, False], ids=["chat", "completions"])
def test_cache_salt_is_taken_and_checked_as_vllm_checks_it(front, is_chat):
    def body(salt) -> bytes:
        return chat([TEXT], cache_salt=salt) if is_chat else \
            json.dumps({"model": MODEL, "prompt": "Hi", "cache_salt": salt}).encode()

    prepared, _ = front.prepare(body("team-a"), chat=is_chat)
    assert prepared.cache_salt == "team-a"
    for bad in ("", "x" * (MAX_SALT_CHARS + 1), "a/b", "a@b", "a\x00b", 7):
        ev = refusal(front, body(bad), is_chat=is_chat)
        assert (ev.status, ev.param) == (400, "cache_salt"), bad


def test_the_scope_is_the_tenant_and_the_salt():
    assert cache_scope(None, "", share_across_tenants=False) == ""  # keys off, no salt: fleet-wide as before
    a, b = cache_scope("aaaa", "", share_across_tenants=False), cache_scope("bbbb", "", share_across_tenants=False)
    assert a and b and a != b and a == cache_scope("aaaa", "", share_across_tenants=False)
    shared = cache_scope("aaaa", "", share_across_tenants=True)
    assert shared == cache_scope("bbbb", "", share_across_tenants=True) == ""
    assert cache_scope("aaaa", "s", share_across_tenants=True) == cache_scope("bbbb", "s", share_across_tenants=True)
    assert cache_scope("aaaa", "s", share_across_tenants=False) not in (a, cache_scope("aaaa", "t",
                                                                                       share_across_tenants=False))
    assert "s" not in cache_scope(None, "s", share_across_tenants=False)  # a digest, not the salt


def test_the_scope_seeds_every_block_hash():
    ids = list(range(40))
    plain = block_hashes(ids, [], placeholder_id=999, block_size=8)
    assert plain == block_hashes(ids, [], placeholder_id=999, block_size=8, salt="")
    one, other = (block_hashes(ids, [], placeholder_id=999, block_size=8, salt=s) for s in ("s1", "s2"))
    assert len(one) == len(plain) == 5
    assert not set(one) & set(plain) and not set(one) & set(other)
    assert one == block_hashes(ids, [], placeholder_id=999, block_size=8, salt="s1")


class _Index:
    def __init__(self) -> None:
        self.entries: set[str] = set()

    async def resolve(self, key: str):
        return object() if key in self.entries else None


async def test_a_name_is_resolved_in_its_scope_before_admission():
    index = _Index()
    names = MediaNames(index, "fp")
    item = MediaInput("image", "messages[0].content[1]", uuid="cat-1", max_pixels=1000)
    index.entries.add(item_key("fp", "image", "cat-1", "scope-a", min_pixels=0, max_pixels=1000, num_frames=0,
                               fps=0.0))
    await names.check([item], "scope-a")
    await names.check([MediaInput("image", "p", url="https://x/y.png", uuid="new")], "scope-b")  # data: no lookup
    for scope, other in (("scope-b", item), ("scope-a", MediaInput("image", item.param, uuid="cat-1"))):
        with pytest.raises(Rejected) as info:  # another tenant, or other processing options
            await names.check([other], scope)
        ev = info.value.event
        assert (ev.status, ev.param, ev.code) == (400, "messages[0].content[1]", "unknown_media_uuid")
        assert "cat-1" in ev.message
    with pytest.raises(Rejected) as info:
        await MediaNames(None, "").check([item], "scope-a")
    assert info.value.event.code == "unknown_media_uuid"
