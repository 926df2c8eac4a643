"""Tiny random-weight Qwen2-Audio, built fully offline, for tests and local fleets. Contract as
:mod:`shared.models.qwen2_vl_tiny`: ``build_tiny_qwen2_audio(out_dir, seed=0)`` writes a directory
that ``AutoProcessor`` and ``Qwen2AudioForConditionalGeneration`` load under ``HF_HUB_OFFLINE=1``;
``ensure_tiny_qwen2_audio(cache_root)`` builds once into ``cache_root/qwen2-audio-tiny-<recipe
hash>``. Weights are seeded and fan-in scaled (``_init_weights``) like the Qwen2-VL build's, so
the output depends on the audio with usable argmax margins; weights in the hub layout
(:mod:`shared.models.weight_layout`), which transformers and vLLM both load.

Design: docs/guide/models.md.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shared.models import build_cache, weight_layout
from shared.models import qwen2_vl_tiny as vl
from shared.models import tokenizer_build as tb
from shared.models.build_cache import build_once

MODEL_NAME = "qwen2-audio-tiny"
AUDIO, AUDIO_BOS, AUDIO_EOS = "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"
SAMPLING_RATE = 16_000
N_MELS = 128

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- elif part['type'] in ['audio', 'audio_url', 'input_audio'] or 'audio' in part -%}"
    "{{- '<|audio_bos|><|AUDIO|><|audio_eos|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- endif -%}"
)


def recipe_hash(seed: int) -> str:
    return build_cache.recipe_hash(seed, (Path(__file__), Path(tb.__file__), Path(vl.__file__),
                                         Path(weight_layout.__file__)))


def _init_weights(model: torch.nn.Module, seed: int) -> None:
    vl.init_weights_fan_in(model, seed, ("embed_tokens", "embed_positions"))


def build_tiny_qwen2_audio(out_dir: Path, *, seed: int = 0) -> Path:
    """Build tokenizer, processor and random model into ``out_dir``; return it. Model facts:

    - Tokenizer: the project's byte-level BPE (``tokenizer_build``) plus ``<|AUDIO|>``,
      ``<|audio_bos|>``, ``<|audio_eos|>`` as special tokens, their ids read back into the config
      (``audio_token_id``); an audio part renders ``<|audio_bos|><|AUDIO|><|audio_eos|>`` (one
      placeholder that prefill expands to the clip's token count).
    - Feature extractor: Whisper, 128 mel bins at 16 kHz; every clip padded to 30 s, so
      ``input_features`` is always ``[128, 3000]``; ``L`` valid frames give
      ``((L - 1) // 2 + 1 - 2) // 2 + 1`` LM tokens.
    - Audio encoder: 2 layers, d_model 64, 2 heads; projector into the LM's 128 hidden size. Text
      model as the Qwen2-VL tiny build (hidden 128, 2 layers, 4 heads × 32, 2 KV heads), plain
      RoPE positions (``rope_delta`` is always 0)."""
    from transformers import (
        GenerationConfig,
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = tb.build_qwen2_tokenizer(seed=seed)
    tokenizer.add_special_tokens({"additional_special_tokens": [AUDIO, AUDIO_BOS, AUDIO_EOS]})
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in (*tb.SPECIAL_TOKENS, AUDIO, AUDIO_BOS, AUDIO_EOS)}
    if len(set(ids.values())) != len(ids):
        raise RuntimeError(f"special tokens not registered distinctly: {ids}")
    processor = Qwen2AudioProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=N_MELS, sampling_rate=SAMPLING_RATE),
        tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    text = vl.text_config_dict(len(tokenizer), ids)
    text.pop("rope_parameters")
    text.update(model_type="qwen2", rope_theta=10000.0)
    config = Qwen2AudioConfig(
        audio_config={"model_type": "qwen2_audio_encoder", "d_model": 64, "encoder_layers": 2,
                      "encoder_attention_heads": 2, "encoder_ffn_dim": 128, "num_mel_bins": N_MELS,
                      "max_source_positions": 1500},
        text_config=text, audio_token_id=ids[AUDIO])
    model = Qwen2AudioForConditionalGeneration(config).to(torch.float32).eval()
    _init_weights(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[tb.ENDOFTEXT], eos_token_id=[ids[tb.IM_END], ids[tb.ENDOFTEXT]],
        pad_token_id=ids[tb.ENDOFTEXT], do_sample=False)
    model.save_pretrained(out_dir)
    weight_layout.save_in_hub_layout(out_dir, "qwen2_audio")
    processor.save_pretrained(out_dir)
    return out_dir


def ensure_tiny_qwen2_audio(cache_root: Path, *, seed: int = 0) -> Path:
    """``cache_root/qwen2-audio-tiny-<hash>``, built once (race-safe as ensure_tiny_qwen2_vl)."""
    final = Path(cache_root) / f"{MODEL_NAME}-{recipe_hash(seed)}"
    return build_once(final, lambda d: build_tiny_qwen2_audio(d, seed=seed), seed=seed)
