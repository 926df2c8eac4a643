"""Qwen2-Audio split compute path: encode, prefill and decode as separate pure steps, with the
same interface as :class:`shared.engines.qwen2_vl.Qwen2VLCompute` so the transformers engine
drives either.

Contract per step:
- ``preprocess_audio`` (an :class:`AudioPreprocessor`): float32 mono samples at
  ``sampling_rate`` → the processor's ``input_features`` ``[n_mels, 3000]`` (every clip padded
  to 30 s), ``meta = (valid feature frames,)`` and the clip's LM token count.
- ``encode_images(items)`` (name shared with Qwen2-VL) runs ONE audio-tower + projector forward
  over any number of clips and returns each clip's first ``n_tokens`` rows ``[n_tokens, hidden]``
  — exactly the features ``forward`` merges at the ``<|AUDIO|>`` positions.
- ``prefill`` expands each ``<|AUDIO|>`` placeholder to its clip's token count, merges the
  embeddings and runs the LM with plain positions (``rope_delta`` is always 0).
- ``start_decode`` / ``decode_step`` continue from a packed KV on any instance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from shared.engines.qwen2_vl import DecodeState, ImagePixels, PrefillResult, _kind


def n_audio_tokens(valid_frames: int) -> int:
    """LM tokens of a clip with ``valid_frames`` feature frames (the processor's formula)."""
    return ((valid_frames - 1) // 2 + 1 - 2) // 2 + 1


class AudioPreprocessor:
    """The model's own feature extractor alone (no weights): what media-fetch runs."""

    def __init__(self, model_dir: Path | str, *, processor=None) -> None:
        if processor is None:
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(str(model_dir))
        self._fe = processor.feature_extractor
        self.sampling_rate = int(self._fe.sampling_rate)

    def __call__(self, samples: np.ndarray) -> ImagePixels:
        out = self._fe([samples], sampling_rate=self.sampling_rate, return_attention_mask=True,
                       padding="max_length", return_tensors="pt")
        valid = int(out["attention_mask"][0].sum())
        return ImagePixels(out["input_features"][0].to(torch.float32).contiguous(), (0, 0, 0),
                           n_audio_tokens(valid), "audio", (valid,))


class Qwen2AudioCompute:
    def __init__(self, model_dir: Path | str) -> None:
        from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

        self.model_dir = Path(model_dir)
        self.processor = AutoProcessor.from_pretrained(str(self.model_dir))
        self.model = Qwen2AudioForConditionalGeneration.from_pretrained(str(self.model_dir),
                                                                        dtype=torch.float32).eval()
        cfg = self.model.config
        text_cfg = cfg.text_config
        self.placeholder_token_id: int = int(cfg.audio_token_id)
        self.hidden_size: int = int(text_cfg.hidden_size)
        self.n_layers: int = int(text_cfg.num_hidden_layers)
        self.n_kv_heads: int = int(text_cfg.num_key_value_heads)
        self.head_dim: int = int(getattr(text_cfg, "head_dim", None)
                                 or text_cfg.hidden_size // text_cfg.num_attention_heads)
        self.max_model_len: int = int(text_cfg.max_position_embeddings)
        eos = self.model.generation_config.eos_token_id
        eos = text_cfg.eos_token_id if eos is None else eos
        self.eos_token_ids = frozenset(int(i) for i in ([eos] if isinstance(eos, int) else list(eos or [])))
        self.preprocess_audio = AudioPreprocessor(self.model_dir, processor=self.processor)

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    def render_prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ---- encode ---------------------------------------------------------------
    @torch.inference_mode()
    def encode_images(self, items: list[ImagePixels]) -> list[torch.Tensor]:
        """One audio-tower forward over every clip; float32 ``[n_tokens, hidden]`` each."""
        from transformers.masking_utils import create_bidirectional_mask

        if not items:
            return []
        if any(_kind(it) != "audio" for it in items):
            raise ValueError(f"Qwen2-Audio encodes audio, not {sorted({_kind(it) for it in items} - {'audio'})}")
        tower = self.model.model.audio_tower
        features = torch.stack([it.pixel_values for it in items])  # [n, mels, 3000]
        valid = torch.tensor([it.meta[0] for it in items], dtype=torch.long)
        feat_lengths, _ = tower._get_feat_extract_output_lengths(valid)
        max_len = (features.shape[-1] - 2) // 2 + 1
        mask_2d = (torch.arange(max_len)[None, :] < feat_lengths[:, None]).to(torch.long)
        mask = create_bidirectional_mask(config=tower.config, inputs_embeds=torch.zeros(len(items), max_len, 1),
                                         attention_mask=mask_2d)
        hidden = tower(features, attention_mask=mask).last_hidden_state
        projected = self.model.model.multi_modal_projector(hidden)
        out = [projected[i, : it.n_tokens].to(torch.float32).contiguous().clone() for i, it in enumerate(items)]
        for it, f in zip(items, out):
            if f.shape != (it.n_tokens, self.hidden_size):
                raise RuntimeError(f"encoder output {tuple(f.shape)} != ({it.n_tokens}, {self.hidden_size})")
        return out

    # ---- prefill --------------------------------------------------------------
    def expand_prompt(self, prompt_ids: list[int], items: list) -> list[int]:
        found = sum(1 for t in prompt_ids if t == self.placeholder_token_id)
        if found != len(items) or any(_kind(it) != "audio" for it in items):
            raise ValueError(f"prompt has {found} audio placeholders but items {[_kind(it) for it in items]} given")
        expanded: list[int] = []
        it = iter(items)
        for tok in prompt_ids:
            expanded.extend([tok] * (next(it)[0].shape[0] if tok == self.placeholder_token_id else 1))
        return expanded

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], items: list) -> PrefillResult:
        from transformers import DynamicCache

        input_ids = torch.tensor([self.expand_prompt(prompt_ids, items)], dtype=torch.long)
        embeds = self.model.get_input_embeddings()(input_ids)
        if items:
            is_audio = (input_ids == self.placeholder_token_id).unsqueeze(-1)
            embeds = embeds.masked_scatter(is_audio, torch.cat([it[0].to(embeds.dtype) for it in items]))
        seq_len = input_ids.shape[1]
        out = self.model(inputs_embeds=embeds, position_ids=torch.arange(seq_len)[None, :],
                         past_key_values=DynamicCache(config=self.model.config.text_config), use_cache=True,
                         logits_to_keep=1)
        return PrefillResult(last_logits=out.logits[0, -1].to(torch.float32).clone(),
                             kv=self.pack_kv(out.past_key_values), rope_delta=0, prompt_len=seq_len)

    @staticmethod
    def pack_kv(cache) -> torch.Tensor:
        per_layer = [torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers]
        return torch.stack(per_layer).to(torch.float32).contiguous()

    # ---- decode ---------------------------------------------------------------
    @torch.inference_mode()
    def start_decode(self, kv_packed: torch.Tensor, rope_delta: int, seq_len: int) -> DecodeState:
        from transformers import DynamicCache

        expected = (self.n_layers, 2, self.n_kv_heads, seq_len, self.head_dim)
        if tuple(kv_packed.shape) != expected:
            raise ValueError(f"packed KV shape {tuple(kv_packed.shape)} != {expected}")
        kv = kv_packed.to(torch.float32)
        layers = [(kv[i, 0].unsqueeze(0).clone(), kv[i, 1].unsqueeze(0).clone()) for i in range(self.n_layers)]
        cache = DynamicCache(ddp_cache_data=layers, config=self.model.config.text_config)
        return DecodeState(cache=cache, rope_delta=0, seq_len=seq_len)

    @torch.inference_mode()
    def decode_step(self, state: DecodeState, token_id: int) -> torch.Tensor:
        cache_len = state.cache.get_seq_length()
        out = self.model(input_ids=torch.tensor([[token_id]], dtype=torch.long),
                         position_ids=torch.tensor([[cache_len]], dtype=torch.long),
                         past_key_values=state.cache, use_cache=True)
        state.seq_len = cache_len + 1
        return out.logits[0, -1].to(torch.float32).clone()
