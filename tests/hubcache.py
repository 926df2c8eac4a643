"""A tiny checkpoint laid out as the Hugging Face hub keeps a VLM repository, placed in a hub
cache of its own (shared.models.hub_layout): what the hub-id tests serve and load.

The processor's template (``chat_template.json`` / ``.jinja``) differs from the tokenizer's
(``tokenizer_config.json``): it adds a default system prompt, with a ``terse`` template variable
for ``chat_template_kwargs``. A server that rendered with the tokenizer's template would feed the
model another prompt than ``processor.apply_chat_template`` (the ``generate()`` reference) does.
"""

from __future__ import annotations

from pathlib import Path

from shared.models import tokenizer_build as tb

REPO_ID = "mmfleet-test/Qwen2-VL-tiny-Instruct"
SYSTEM_PROMPT = "You are a helpful assistant."
TERSE_PROMPT = "Be terse."
PROCESSOR_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\n' + ('" + TERSE_PROMPT + "' if terse is defined and terse else '"
    + SYSTEM_PROMPT + "') + '<|im_end|>\n' -}}"
    "{%- endif -%}" + tb.CHAT_TEMPLATE
)


def build_hub_cache(src: Path, cache_dir: Path, *, template_file: str = "json", repo_id: str = REPO_ID) -> Path:
    """``src`` (a tiny Qwen2-VL build) as hub files in bf16 (built once per checkout beside the
    tiny models), placed under ``cache_dir`` as ``repo_id`` at refs/main; returns the snapshot."""
    import hashlib

    from shared.models import hub_layout
    from shared.models.build_cache import MARKER, build_once
    from tests.conftest import CACHE_DIR

    recipe = hashlib.sha256(Path(__file__).read_bytes() + Path(hub_layout.__file__).read_bytes()).hexdigest()[:8]
    staged = build_once(CACHE_DIR / "hub-staged" / f"{Path(src).name}-{template_file}-{recipe}",
                        lambda out: _stage(Path(src), out, template_file), seed=0)
    return hub_layout.place_in_hub_cache(staged, cache_dir, repo_id, skip=(MARKER,))


def _stage(src: Path, out: Path, template_file: str) -> None:
    import tempfile

    import torch
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    from shared.models.hub_layout import save_hub_files

    with tempfile.TemporaryDirectory() as tmp:
        with_template = Path(tmp)
        processor = AutoProcessor.from_pretrained(str(src))
        processor.chat_template = PROCESSOR_TEMPLATE
        processor.save_pretrained(with_template)
        for f in src.iterdir():  # weights and configs as they are
            if not (with_template / f.name).exists():
                (with_template / f.name).symlink_to(f)
        save_hub_files(with_template, out, model_cls=Qwen2VLForConditionalGeneration, dtype=torch.bfloat16,
                       max_shard_size="1MB", template_file=template_file, tokenizer_template=tb.CHAT_TEMPLATE)
