"""Qwen2-Audio split compute path (:class:`Qwen2AudioCompute`), with the interface of
:class:`shared.engines.qwen2_vl.Qwen2VLCompute` so the transformers engine drives either.
``preprocess_audio`` (:class:`AudioPreprocessor`): float32 mono samples at ``sampling_rate`` →
the processor's ``input_features`` ``[n_mels, 3000]`` (every clip padded to 30 s), ``meta =
(valid feature frames,)`` and the clip's LM token count. ``encode_media`` runs ONE audio-tower +
projector forward over any number of clips: each clip's first ``n_tokens`` rows, exactly what
``forward`` merges at ``<|AUDIO|>``. Prefill and decode: :class:`PlainLMCompute`.

Design: docs/guide/models.md.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from shared.engines.plain_lm import PlainLMCompute
from shared.engines.qwen2_vl import MediaPixels, _kind


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

    def __call__(self, samples: np.ndarray) -> MediaPixels:
        out = self._fe([samples], sampling_rate=self.sampling_rate, return_attention_mask=True,
                       padding="max_length", return_tensors="pt")
        valid = int(out["attention_mask"][0].sum())
        return MediaPixels(out["input_features"][0].to(torch.float32).contiguous(), (0, 0, 0),
                           n_audio_tokens(valid), "audio", (valid,))


class Qwen2AudioCompute(PlainLMCompute):
    """Prefill and decode (plain positions) come from :class:`PlainLMCompute`."""

    kind = "audio"

    def __init__(self, model_dir: Path | str, *, device: str = "cpu", dtype: str = "auto",
                 parts: frozenset[str] | None = None) -> None:
        from transformers import Qwen2AudioForConditionalGeneration

        self._load(Qwen2AudioForConditionalGeneration, model_dir, device, dtype, parts)
        self.placeholder_token_id: int = int(self.model.config.audio_token_id)
        self._init_lm()
        self.preprocess_audio = AudioPreprocessor(self.model_dir, processor=self.processor)

    # ---- encode ---------------------------------------------------------------
    @torch.inference_mode()
    def encode_media(self, items: list[MediaPixels]) -> list[torch.Tensor]:
        """One audio-tower forward over every clip; ``[n_tokens, hidden]`` each, in the model dtype."""
        from transformers.masking_utils import create_bidirectional_mask

        if not items:
            return []
        if any(_kind(it) != "audio" for it in items):
            raise ValueError(f"Qwen2-Audio encodes audio, not {sorted({_kind(it) for it in items} - {'audio'})}")
        tower = self.model.model.audio_tower
        dev = self.device
        features = torch.stack([it.pixel_values for it in items]).to(dev, self.dtype)  # [n, mels, 3000]
        valid = torch.tensor([it.meta[0] for it in items], dtype=torch.long, device=dev)
        feat_lengths, _ = tower._get_feat_extract_output_lengths(valid)
        max_len = (features.shape[-1] - 2) // 2 + 1
        mask_2d = (torch.arange(max_len, device=dev)[None, :] < feat_lengths[:, None]).to(torch.long)
        mask = create_bidirectional_mask(config=tower.config,
                                         inputs_embeds=torch.zeros(len(items), max_len, 1, device=dev,
                                                                 dtype=self.dtype),
                                         attention_mask=mask_2d)
        hidden = tower(features, attention_mask=mask).last_hidden_state
        projected = self.model.model.multi_modal_projector(hidden)
        out = [projected[i, : it.n_tokens].to(self.dtype).contiguous().clone() for i, it in enumerate(items)]
        for it, f in zip(items, out):
            if f.shape != (it.n_tokens, self.hidden_size):
                raise RuntimeError(f"encoder output {tuple(f.shape)} != ({it.n_tokens}, {self.hidden_size})")
        return out
