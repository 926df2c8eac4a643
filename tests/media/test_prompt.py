"""The gateway's validation of content parts (what needs no I/O): every bad part is a 4xx
RequestFailed naming the part; a property test feeds arbitrary parts and bodies."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gateway import schema
from services.gateway.prompt import PromptBuilder
from shared.settings import Settings
from shared.stage import RequestFailed
from tests.media import samples


@pytest.fixture(scope="module")
def builder(model_dir):
    from transformers import AutoTokenizer

    from shared.models.registry import family_of

    tok = AutoTokenizer.from_pretrained(model_dir)
    s = Settings(media_allow_hosts=("127.0.0.1:8123",), max_image_bytes=50_000, media_file_root="/srv/media")
    return PromptBuilder(tok, placeholders=family_of(model_dir).placeholders, max_model_len=4096, settings=s)


def body(*parts, role="user") -> bytes:
    return json.dumps({"model": "mmfleet-demo", "messages": [{"role": role, "content": list(parts)}]}).encode()


def img(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def build(builder, raw: bytes):
    return builder.chat(schema.parse_chat(raw))


def failed(builder, raw: bytes) -> RequestFailed:
    with pytest.raises(RequestFailed) as info:
        build(builder, raw)
    return info.value


def test_good_parts(builder):
    p = build(builder, body({"type": "text", "text": "hi"}, img(samples.data_url(samples.png())),
                            img("https://example.com/a.png", detail="auto"), img("http://127.0.0.1:8123/a.png"),
                            img("file:///srv/media/a.png")))
    assert [m.kind for m in p.media] == ["image"] * 4
    assert p.media[0].data == samples.png() and p.media[0].mime == "image/png"
    assert p.media[1].url == "https://example.com/a.png"
    assert p.media[3].url == "file:///srv/media/a.png"


@pytest.mark.parametrize("part, status, fragment", [
    (img(""), 400, "URL is empty"),
    (img("   "), 400, "URL is empty"),
    (img("example.com/a.png"), 400, "unsupported URL scheme (none)"),
    (img("ftp://example.com/a.png"), 400, "unsupported URL scheme 'ftp'"),
    (img("javascript:alert(1)"), 400, "unsupported URL scheme 'javascript'"),
    (img("http://127.0.0.1/a.png"), 400, "loopback"),
    (img("http://127.0.0.1:8124/a.png"), 400, "loopback"),
    (img("http://[::1]:8123/a.png"), 400, "loopback"),
    (img("http://169.254.169.254/"), 400, "cloud metadata"),
    (img("http://0x7f.1:8123/"), 400, "non-standard form"),
    (img("file:///srv/media/../../etc/passwd"), 400, "'..' segments"),
    (img("file://otherhost/srv/media/a.png"), 400, "host 'otherhost' is not allowed"),
    (img("data:image/png;base64,!!!"), 400, "invalid base64"),
    (img("data:text/html;base64,PGh0bWw+"), 400, "does not match an image_url part"),
    (img(samples.data_url(b"\x00" * 60_000)), 413, "50000 byte limit"),
    (img("https://example.com/a.png", detail="ultra"), 400, "image_url.detail: only 'auto' is supported"),
    (img("https://example.com/a.png", detail="low"), 400, "image_url.detail: only 'auto' is supported"),
])
def test_bad_parts(builder, part, status, fragment):
    err = failed(builder, body({"type": "text", "text": "x"}, part))
    ev = err.event
    assert ev.status == status and fragment in ev.message, ev.message
    # the part, or the field inside it that is wrong
    assert ev.param.startswith("messages[0].content[1]") and ev.message.startswith(ev.param + ": ")


def test_file_urls_are_refused_when_not_enabled(builder, model_dir):
    s = Settings()
    off = PromptBuilder(builder._tok, placeholders=builder._placeholders, max_model_len=4096, settings=s)
    assert "file:// URLs are not enabled" in failed(off, body(img("file:///srv/media/a.png"))).event.message


def test_images_outside_user_messages(builder):
    assert "user messages only" in failed(builder, body(img("https://example.com/a.png"), role="system")).event.message


def video(url: str, **extra) -> dict:
    return {"type": "video_url", "video_url": {"url": url, **extra}}


def test_modality_the_model_does_not_take_is_400(builder):
    for part, modality in (({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio"),
                           ({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}, "audio")):
        ev = failed(builder, body(part)).event
        assert ev.status == 400 and ev.code == "unsupported_modality", ev
        assert f"model 'mmfleet-demo' does not accept {modality} input" in ev.message, ev.message
        assert ev.message.startswith("messages[0].content[0]: ") and "it accepts text, image, video" in ev.message
    images_only = PromptBuilder(builder._tok, placeholders={"image": "<|image_pad|>"}, max_model_len=4096,
                                settings=builder._s)
    ev = failed(images_only, body(video("https://example.com/v.mp4"))).event
    assert ev.status == 400 and "does not accept video input (video_url parts); it accepts text, image" in ev.message


def test_video_parts(builder):
    p = build(builder, body(video("https://example.com/v.mp4", num_frames=4), img("https://example.com/a.png"),
                            video("https://example.com/w.webm", fps=2.0)))
    assert [(m.kind, m.num_frames, m.fps) for m in p.media] == [("video", 4, 0.0), ("image", 0, 0.0),
                                                                  ("video", 0, 2.0)]
    video_id = builder._tok.convert_tokens_to_ids("<|video_pad|>")
    image_id = builder._tok.convert_tokens_to_ids("<|image_pad|>")
    assert [t for t in p.prompt_token_ids if t in (video_id, image_id)] == [video_id, image_id, video_id]
    inline = build(builder, body(video(samples.data_url(b"\x1aE\xdf\xa3webm", "video/webm"))))
    assert inline.media[0].data == b"\x1aE\xdf\xa3webm" and inline.media[0].mime == "video/webm"


@pytest.mark.parametrize("extra, fragment", [
    ({"num_frames": 0}, "num_frames must be between 1 and 32"),
    ({"num_frames": 33}, "num_frames must be between 1 and 32"),
    ({"fps": 0}, "fps must be above 0"),
    ({"num_frames": 2, "fps": 1.0}, "not both"),
])
def test_bad_video_sampling(builder, extra, fragment):
    ev = failed(builder, body(video("https://example.com/v.mp4", **extra))).event
    assert ev.status == 400 and fragment in ev.message, ev.message


def test_video_data_url_mime(builder):
    ev = failed(builder, body(video("data:image/png;base64,AAAA"))).event
    assert ev.status == 400 and "does not match a video_url part" in ev.message, ev.message
    ev = failed(builder, body(video("data:video/avi;base64,AAAA"))).event
    assert "video type 'video/avi' is not accepted" in ev.message, ev.message


def test_too_many_items_is_413(builder):
    err = failed(builder, body(*[img("https://example.com/a.png")] * 9))
    assert err.event.status == 413 and "the limit is 8" in err.event.message


_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=3), max_leaves=8)
_urls = st.one_of(st.text(max_size=60), st.sampled_from([
    "http://127.0.0.1/", "https://example.com/a.png", "data:image/png;base64,AAAA", "file:///etc/passwd",
    "http://2130706433/", "data:image/png;base64," + samples.data_url(samples.png()).split(",")[1]]),
    st.builds(lambda s, r: s + r,
              st.sampled_from(["http://", "https://", "data:", "file://", "data:image/png;base64,"]),
              st.text(max_size=60)))
_parts = st.one_of(
    st.builds(lambda u, d: {"type": "image_url", "image_url": {"url": u, **({"detail": d} if d else {})}}, _urls,
              st.sampled_from([None, "auto", "high", "x"])),
    st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=30)),
    st.dictionaries(st.sampled_from(["type", "image_url", "text", "video_url", "input_audio"]), _json_values,
                    max_size=3))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(parts=st.lists(_parts, max_size=4), role=st.sampled_from(["user", "system", "assistant", "robot"]))
def test_property_parts_never_fail_with_a_5xx(builder, parts, role):
    raw = json.dumps({"model": "mmfleet-demo", "messages": [{"role": role, "content": parts}]}).encode()
    try:
        build(builder, raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass  # the gateway answers these with a 400
    except RequestFailed as err:
        assert 400 <= err.event.status < 500, err.event


@pytest.fixture(scope="module")
def audio_builder(model_dir):
    """A builder for a model that takes audio: the tiny tokenizer plus an audio placeholder and
    a chat template that renders audio parts (what an audio family's template does)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|AUDIO|>"]})
    tok.chat_template = ("{%- for m in messages -%}{{- m['role'] + ': ' -}}{%- if m['content'] is string -%}"
                         "{{- m['content'] -}}{%- else -%}{%- for p in m['content'] -%}"
                         "{%- if p['type'] == 'text' -%}{{- p['text'] -}}{%- elif p['type'] == 'audio' -%}"
                         "{{- '<|AUDIO|>' -}}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endfor -%}")
    s = Settings(max_audio_bytes=50_000)
    return PromptBuilder(tok, placeholders={"audio": "<|AUDIO|>"}, max_model_len=4096, settings=s)


def test_audio_parts(audio_builder):
    wav = samples.wav(0.1)
    p = build(audio_builder, body({"type": "input_audio", "input_audio": {"data": samples.b64(wav), "format": "wav"}},
                                  {"type": "audio_url", "audio_url": {"url": "https://example.com/a.mp3"}},
                                  {"type": "text", "text": "what is said?"}))
    assert [(m.kind, m.mime, m.data == wav, m.url) for m in p.media] == [
        ("audio", "audio/wav", True, ""), ("audio", "", False, "https://example.com/a.mp3")]
    audio_id = audio_builder._tok.convert_tokens_to_ids("<|AUDIO|>")
    assert p.prompt_token_ids.count(audio_id) == 2
    ev = failed(audio_builder, body(img("https://example.com/a.png"))).event
    assert ev.status == 400 and "does not accept image input (image_url parts); it accepts text, audio" in ev.message


@pytest.mark.parametrize("part, status, fragment", [
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "flac"}}, 400,
     "input_audio.format must be one of wav, mp3"),
    ({"type": "input_audio", "input_audio": {"data": "!!!!", "format": "wav"}}, 400, "invalid base64"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "mp3"}}, 400, "data URL is empty"),
    ({"type": "input_audio", "input_audio": {"data": "A" * 80_000, "format": "wav"}}, 413, "50000 byte limit"),
    ({"type": "audio_url", "audio_url": {"url": "data:video/mp4;base64,AAAA"}}, 400,
     "does not match an audio_url part"),
])
def test_bad_audio_parts(audio_builder, part, status, fragment):
    ev = failed(audio_builder, body(part)).event
    assert ev.status == status and fragment in ev.message, ev.message
