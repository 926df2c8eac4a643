"""The ``model`` setting: a local folder or a hub id resolved offline in a hub cache laid out as
huggingface_hub keeps one (refs/main -> snapshot, sharded bf16 safetensors + index, processor
files, chat_template.json / .jinja); the old ``model_path`` name; ``served_model_name`` following
the id; a missing id naming the id and the cache; chat templates where real checkpoints keep them."""

from __future__ import annotations

import json

import pytest
import torch

from services.cli import _parser, load_settings
from services.gateway import schema
from services.gateway.prompt import PromptBuilder
from shared.models.hub import ModelNotFound, resolve_model
from shared.models.registry import resolve_model_path
from shared.settings import Settings, from_env
from shared.stage import RequestFailed
from tests.hubcache import PROCESSOR_TEMPLATE, REPO_ID, SYSTEM_PROMPT, TERSE_PROMPT, build_hub_cache


@pytest.fixture(scope="module")
def hub(model_dir, tmp_path_factory):
    """(cache dir, snapshot) with the tiny model as REPO_ID, chat template in chat_template.json."""
    cache = tmp_path_factory.mktemp("hubjson") / "hub"
    return cache, build_hub_cache(model_dir, cache, template_file="json")


def test_model_setting_names_and_served_name(tmp_path):
    assert from_env({"MMFLEET_MODEL_PATH": "/m"}).model == "/m"  # the old name still works
    assert from_env({"MMFLEET_MODEL_PATH": "/old", "MMFLEET_MODEL": "/new"}).model == "/new"
    assert from_env({}, model_path="/kw").model == "/kw"
    cfg = tmp_path / "c.toml"
    cfg.write_text('model_path = "/file"\n')
    assert from_env({}, config_file=cfg).model == "/file"
    s = from_env({"MMFLEET_MODEL": "org/name"})
    assert s.served_model_name == "org/name"  # vLLM's default: the model as given
    assert from_env({"MMFLEET_MODEL": "org/name", "MMFLEET_SERVED_MODEL_NAME": "x"}).served_model_name == "x"
    assert from_env({}).served_model_name == "mmfleet-demo"  # the demo model
    # named by its old name, the served name stays the old default: existing set-ups keep working
    assert from_env({"MMFLEET_MODEL_PATH": "/m"}).served_model_name == "mmfleet-demo"
    assert from_env({}, model_path="/kw").served_model_name == "mmfleet-demo"
    assert from_env({}, config_file=cfg).served_model_name == "mmfleet-demo"
    assert from_env({"MMFLEET_MODEL_PATH": "/m"}, model="org/x").served_model_name == "org/x"
    for flag, served in (("--model", "org/name"), ("--model-path", "mmfleet-demo")):
        args = _parser().parse_args(["worker", "--stages", "encode", flag, "org/name", "--revision", "v1"])
        s = load_settings(args, env={})
        assert (s.model, s.revision, s.served_model_name) == ("org/name", "v1", served)


def test_hub_id_resolves_to_the_cached_snapshot(hub):
    from huggingface_hub import scan_cache_dir

    cache, snapshot = hub
    info = scan_cache_dir(cache)  # the layout is one huggingface_hub itself reads
    (repo,) = info.repos
    assert repo.repo_id == REPO_ID and {r.commit_hash for r in repo.revisions} == {snapshot.name}
    assert {ref for r in repo.revisions for ref in r.refs} == {"main"}
    assert resolve_model(REPO_ID, cache_dir=str(cache)) == snapshot
    assert resolve_model(REPO_ID, revision=snapshot.name, cache_dir=str(cache)) == snapshot  # a commit
    assert resolve_model_path(Settings(model=REPO_ID, hub_cache_dir=str(cache))) == snapshot
    names = {p.name for p in snapshot.iterdir()}
    assert {"model.safetensors.index.json", "preprocessor_config.json", "chat_template.json",
            "tokenizer_config.json", "config.json"} <= names
    assert len([n for n in names if n.startswith("model-0000")]) > 1  # sharded
    assert "processor_config.json" not in names and all((snapshot / n).is_symlink() for n in names)


def test_missing_model_names_id_and_cache(hub, tmp_path):
    cache, _ = hub
    with pytest.raises(ModelNotFound) as info:
        resolve_model("mmfleet-test/absent", cache_dir=str(cache))
    assert "'mmfleet-test/absent'" in str(info.value) and str(cache) in str(info.value)
    with pytest.raises(ModelNotFound, match="revision v9"):
        resolve_model(REPO_ID, revision="v9", cache_dir=str(cache))
    with pytest.raises(ModelNotFound, match="neither an existing folder nor a hub id"):
        resolve_model("/no/such/folder", cache_dir=str(cache))
    with pytest.raises(ModelNotFound, match="has no config.json"):
        resolve_model(str(tmp_path))


def test_worker_start_up_error_names_the_id(hub):
    import asyncio

    from services.worker import run_worker

    cache, _ = hub
    s = Settings(model="mmfleet-test/absent", hub_cache_dir=str(cache))
    with pytest.raises(SystemExit, match=f"cannot start worker: model 'mmfleet-test/absent'.*{cache}"):
        asyncio.run(run_worker(s, ["encode"]))


def test_checkpoint_loads_in_its_dtype_with_the_processor_template(hub):
    from transformers import AutoProcessor, AutoTokenizer

    from shared.models.reference import load_reference

    _, snapshot = hub
    assert json.loads((snapshot / "config.json").read_text())["dtype"] == "bfloat16"
    processor, model = load_reference(snapshot)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert processor.chat_template == PROCESSOR_TEMPLATE
    assert AutoTokenizer.from_pretrained(snapshot).chat_template != PROCESSOR_TEMPLATE
    assert AutoProcessor.from_pretrained(snapshot).image_processor.merge_size == 2


def _chat(builder, **extra):
    body = {"model": REPO_ID, "messages": [{"role": "user", "content": "hi"}], **extra}
    prepared = builder.chat(schema.parse_chat(json.dumps(body).encode()))
    return builder._tok.decode(prepared.prompt_token_ids)


@pytest.mark.parametrize("template_file", ["json", "jinja"])
def test_gateway_renders_with_the_processor_template(model_dir, tmp_path, template_file):
    snapshot = build_hub_cache(model_dir, tmp_path / "hub", template_file=template_file)
    builder = PromptBuilder.for_model(snapshot, Settings(model=REPO_ID, served_model_name=REPO_ID))
    assert SYSTEM_PROMPT in _chat(builder)  # the processor's template, not the tokenizer's
    assert TERSE_PROMPT in _chat(builder, chat_template_kwargs={"terse": True})


def test_request_templates_and_the_override_setting(hub, tmp_path):
    _, snapshot = hub
    s = Settings(model=REPO_ID, served_model_name=REPO_ID)
    builder = PromptBuilder.for_model(snapshot, s)
    own = "{%- for m in messages -%}OWN {{ m['content'] }}{%- endfor -%}"
    with pytest.raises(RequestFailed) as info:  # not without the operator's consent, as in vLLM
        _chat(builder, chat_template=own)
    assert info.value.event.status == 400 and info.value.event.param == "chat_template"
    trusting = PromptBuilder.for_model(snapshot, Settings(model=REPO_ID, served_model_name=REPO_ID,
                                                          trust_request_chat_template=True))
    assert _chat(trusting, chat_template=own) == "OWN hi"
    with pytest.raises(RequestFailed) as info:
        _chat(trusting, chat_template="{{ raise_exception('no') }}")
    assert info.value.event.status == 400 and info.value.event.param == "chat_template"
    with pytest.raises(RequestFailed) as info:
        _chat(builder, chat_template_kwargs={"tokenize": True})
    assert info.value.event.param == "chat_template_kwargs" and "tokenize" in info.value.event.message
    path = tmp_path / "t.jinja"
    path.write_text("{%- for m in messages -%}FILE {{ m['content'] }}{%- endfor -%}")
    for value, text in ((str(path), "FILE hi"), ("{{ 'INLINE' }}", "INLINE")):
        overridden = PromptBuilder.for_model(snapshot, Settings(served_model_name=REPO_ID, chat_template=value))
        assert _chat(overridden) == text
    with pytest.raises(ValueError, match="neither an existing file nor a Jinja template"):
        PromptBuilder.for_model(snapshot, Settings(chat_template="/no/such.jinja"))
