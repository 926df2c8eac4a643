"""Random-weight Qwen2-VL models, built fully offline: the tiny one for tests and local fleets,
the "bench" one for benchmarks (a 2B-class VLM's compute proportions), and one with Qwen2-VL-2B's
real shapes for GPU checks (``QWEN2_VL_2B``, bf16, built on CUDA). ``build_tiny_qwen2_vl``
writes a directory that ``AutoProcessor`` and ``Qwen2VLForConditionalGeneration`` load under
``HF_HUB_OFFLINE=1`` (same seed and library versions → identical files); ``ensure_tiny_qwen2_vl``
builds once into ``cache_root/qwen2-vl-<size>-<recipe hash>`` (this module's and the tokenizer's
source, seed, size, library versions). Weights are seeded and fan-in scaled, not transformers'
init (:func:`_init_weights`), so greedy output depends on the image with usable argmax margins.

Design: docs/guide/models.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.models import build_cache
from shared.models import tokenizer_build as tb
from shared.models.build_cache import build_once

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
_TOKEN_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2  # pixels covered by one LM image token


@dataclass(frozen=True)
class Qwen2VLSize:
    """The shape of one buildable Qwen2-VL (text model, vision tower, image token range)."""

    name: str  # the cache dir is qwen2-vl-<name>-<hash>
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    mrope_section: tuple[int, int, int]  # sums to head_dim / 2 (rotary frequencies per M-RoPE axis)
    vision_depth: int
    vision_embed: int
    vision_heads: int
    vision_mlp_ratio: int
    min_tokens: int  # image tokens (after the 2x2 merge) per image, at least / at most
    max_tokens: int
    max_positions: int
    # rows of embed_tokens / lm_head; 0: the trained tokenizer's size. Rows past the tokenizer
    # are padding (as in a real checkpoint's padded vocabulary): zero lm_head rows, logit 0,
    # never the argmax beside the tokenizer's ~1.2k random logits of std ~4
    vocab_size: int = 0
    rope_theta: float = 10000.0
    save_dtype: str = "float32"  # the saved weights' dtype
    build_device: str = "cpu"  # where the weights are drawn (cuda: seconds for billions of them)

    @property
    def head_dim(self) -> int:
        return self.text_hidden // self.text_heads


TINY = Qwen2VLSize("tiny", text_hidden=128, text_layers=2, text_heads=4, text_kv_heads=2, text_intermediate=256,
                   mrope_section=(4, 6, 6), vision_depth=2, vision_embed=64, vision_heads=2, vision_mlp_ratio=2,
                   min_tokens=4, max_tokens=64, max_positions=4096)
# Chosen by measurement on a 2-core machine, 1 torch thread (``python -m loadtest split``; the
# bench model's page in docs/benchmarks/): one 448² image + 32 words spends ~60-65 %
# of in-process TTFT in the vision tower (Qwen2-VL-2B: ~60 % by FLOPs), a 2k-token multi-turn
# prompt is prefill-bound, head_dim 64 as vLLM's CPU kernels want, GQA 2:1, MLP ratio 3 / 4.
BENCH = Qwen2VLSize("bench", text_hidden=256, text_layers=4, text_heads=4, text_kv_heads=2, text_intermediate=768,
                    mrope_section=(8, 12, 12), vision_depth=4, vision_embed=128, vision_heads=2, vision_mlp_ratio=4,
                    min_tokens=4, max_tokens=1024, max_positions=8192)
# Qwen2-VL-2B-Instruct's public config.json: hidden 1536, 28 layers, 12 heads, 2 KV heads (head_dim
# 128), intermediate 8960, mrope_section [16, 24, 24], rope_theta 1e6, 32768 positions, vocab
# 151936; vision depth 32, embed 1280, 16 heads, mlp_ratio 4, patch 14, merge 2; images 4..16384
# tokens (min_pixels 3136, max_pixels 12845056). One difference: the real checkpoint ties lm_head
# to embed_tokens; here they are separate (this module's init keeps logit margins usable), the same
# shapes and FLOPs (2.44 G parameters here, 2.21 G tied; vision 665 M), 4.9 GB in bf16: the GPU
# check's model (loadtest/gpu_vllm_check.py).
QWEN2_VL_2B = Qwen2VLSize("2b", text_hidden=1536, text_layers=28, text_heads=12, text_kv_heads=2,
                          text_intermediate=8960, mrope_section=(16, 24, 24), vision_depth=32, vision_embed=1280,
                          vision_heads=16, vision_mlp_ratio=4, min_tokens=4, max_tokens=16384, max_positions=32768,
                          vocab_size=151936, rope_theta=1_000_000.0, save_dtype="bfloat16", build_device="cuda")
SIZES = {s.name: s for s in (TINY, BENCH, QWEN2_VL_2B)}

# the tiny model's facts, as other builders and tests use them
MODEL_NAME = f"qwen2-vl-{TINY.name}"
MIN_PIXELS = TINY.min_tokens * _TOKEN_PIXELS
MAX_PIXELS = TINY.max_tokens * _TOKEN_PIXELS
TEXT_HIDDEN = TINY.text_hidden
TEXT_LAYERS = TINY.text_layers
TEXT_HEADS = TINY.text_heads
TEXT_KV_HEADS = TINY.text_kv_heads
HEAD_DIM = TINY.head_dim  # 32: vLLM's CPU attention needs >= 32
MROPE_SECTION = list(TINY.mrope_section)

# Weight scales (gain on a 1/sqrt(fan_in) std), chosen by measurement over 8 test
# images (noise, solid colours, gradients; 64x64 to 320x240), 12 greedy tokens each:
# all 28 image pairs give different sequences, 6/8 differ already at token 1, no
# output repeats one token, logits finite with |logit| <= 23, and the top-1/top-2
# logit gap is >= 1e-2 (median 0.76) at every step.  transformers' default init
# (std 0.02) on this config has |logit| <= 1.1 and gaps down to 2e-4: greedy parity
# across kernels (batched encode, vLLM) would hinge on float noise.
TEXT_GAIN = 2.0
VISION_GAIN = 2.0
EMBED_STD = 1.0
LM_HEAD_GAIN = 4.0
BIAS_STD = 0.1


def text_config_dict(vocab_size: int, ids: dict[str, int], size: Qwen2VLSize = TINY) -> dict:
    return {
        "vocab_size": max(vocab_size, size.vocab_size),
        "hidden_size": size.text_hidden,
        "intermediate_size": size.text_intermediate,
        "num_hidden_layers": size.text_layers,
        "num_attention_heads": size.text_heads,
        "num_key_value_heads": size.text_kv_heads,
        "max_position_embeddings": size.max_positions,
        "rope_parameters": {"rope_type": "default", "mrope_section": list(size.mrope_section),
                            "rope_theta": size.rope_theta},
        "bos_token_id": ids[tb.ENDOFTEXT],
        "eos_token_id": ids[tb.IM_END],
        "pad_token_id": ids[tb.ENDOFTEXT],
        "tie_word_embeddings": False,
    }


def vision_config_dict(size: Qwen2VLSize = TINY) -> dict:
    return {
        "depth": size.vision_depth,
        "embed_dim": size.vision_embed,
        "hidden_size": size.text_hidden,  # merger projects into the LM's hidden size
        "num_heads": size.vision_heads,
        "mlp_ratio": size.vision_mlp_ratio,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "in_channels": 3,
    }


def recipe_hash(seed: int, size: Qwen2VLSize = TINY) -> str:
    """Short hash of everything that determines the built files."""
    return build_cache.recipe_hash(seed, (Path(__file__), Path(tb.__file__)), extra={"size": dataclasses.asdict(size)})


def init_weights_fan_in(model: torch.nn.Module, seed: int, embed_names: tuple[str, ...]) -> None:
    """The other families' builders: every parameter from one seeded generator in sorted-name
    order, as :func:`_init_weights` does (norms 1/0, biases N(0, BIAS_STD), parameters whose name
    holds one of ``embed_names`` N(0, EMBED_STD), matrices fan-in scaled with TEXT_GAIN, lm_head
    with LM_HEAD_GAIN), with any parameter whose name holds "norm" taken as a norm."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            if "norm" in name:
                p.fill_(1.0) if name.endswith(".weight") else p.zero_()
                continue
            if name.endswith(".bias"):
                std = BIAS_STD
            elif any(e in name for e in embed_names):
                std = EMBED_STD
            else:
                gain = LM_HEAD_GAIN if name.startswith("lm_head") else TEXT_GAIN
                std = gain / math.sqrt(math.prod(p.shape[1:]))
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


def _init_weights(model: torch.nn.Module, seed: int, n_tokens: int | None = None) -> None:
    """Overwrite every parameter from one seeded generator, in sorted-name order.

    Why not the transformers init: at std 0.02 attention is near uniform and the
    logits are nearly flat, so argmax decisions rest on tiny gaps (or collapse to
    one token on other configs).  Fan-in scaling with gain 2 keeps activations O(1)
    and attention sharp in both towers; a unit-std token embedding and an lm_head
    gain of 4 spread the logits so the image features move the argmax by clear
    margins.  Norm weights are 1 and LayerNorm biases 0, as in a real checkpoint. Rows past
    ``n_tokens`` (a padded vocabulary) of embed_tokens and lm_head are zero. The generator lives
    on the parameters' device (one seeded stream per device, in the same order).
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            if name.endswith("norm.weight") or "norm1." in name or "norm2." in name or "ln_q." in name:
                if name.endswith(".weight"):
                    p.fill_(1.0)
                else:
                    p.zero_()
                continue
            if name.endswith(".bias"):
                std = BIAS_STD
            elif "embed_tokens" in name:
                std = EMBED_STD
            else:
                fan_in = math.prod(p.shape[1:])
                if name.startswith("lm_head"):
                    gain = LM_HEAD_GAIN
                elif "visual" in name:
                    gain = VISION_GAIN
                else:
                    gain = TEXT_GAIN
                std = gain / math.sqrt(fan_in)
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32, device=device) * std)
            if n_tokens is not None and ("embed_tokens" in name or name.startswith("lm_head")):
                p[n_tokens:] = 0.0


def build_tiny_qwen2_vl(out_dir: Path, *, seed: int = 0, size: Qwen2VLSize = TINY) -> Path:
    """Build tokenizer, processor and random model into ``out_dir``; return it.

    ``out_dir`` is created if missing; existing files of the same name are overwritten. Model
    facts other code may rely on: special-token ids are read back from the trained tokenizer and
    written into the config (``image_token_id``, ``video_token_id``, ``vision_start_token_id``,
    ``vision_end_token_id``, bos/eos/pad); eos = ``<|im_end|>``; the generation config lists
    ``[<|im_end|>, <|endoftext|>]`` as eos and is greedy. The image processor is
    ``Qwen2VLImageProcessor`` with the torchvision backend, what ``AutoProcessor`` resolves to in
    the fleet's environment: the fleet and its references must use this ONE backend (PIL and
    torchvision resize slightly differently). Its ``size`` holds pixel counts (min_tokens·28² ..
    max_tokens·28²), so every image becomes ``min_tokens..max_tokens`` image tokens after the 2×2
    merge (TINY: 4..64; BENCH: 4..1024; QWEN2_VL_2B: 4..16384; a 448² image is 256 as in Qwen2-VL-2B).
    """
    from transformers import (
        GenerationConfig,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = tb.build_qwen2_tokenizer(seed=seed)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in tb.SPECIAL_TOKENS}
    if len(set(ids.values())) != len(ids) or tokenizer.unk_token_id in (None,):
        raise RuntimeError(f"special tokens not registered distinctly: {ids}")

    pixel_kwargs = {
        "size": {"shortest_edge": size.min_tokens * _TOKEN_PIXELS, "longest_edge": size.max_tokens * _TOKEN_PIXELS},
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
    }
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**pixel_kwargs),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**pixel_kwargs),
        chat_template=tb.CHAT_TEMPLATE,
    )

    config = Qwen2VLConfig(
        text_config=text_config_dict(len(tokenizer), ids, size),
        vision_config=vision_config_dict(size),
        image_token_id=ids[tb.IMAGE_PAD],
        video_token_id=ids[tb.VIDEO_PAD],
        vision_start_token_id=ids[tb.VISION_START],
        vision_end_token_id=ids[tb.VISION_END],
        bos_token_id=ids[tb.ENDOFTEXT],
        eos_token_id=ids[tb.IM_END],
        pad_token_id=ids[tb.ENDOFTEXT],
        tie_word_embeddings=False,
    )
    with torch.device(size.build_device):
        model = Qwen2VLForConditionalGeneration(config).to(torch.float32).eval()
    _init_weights(model, seed, len(tokenizer) if size.vocab_size > len(tokenizer) else None)
    model.to(getattr(torch, size.save_dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=ids[tb.ENDOFTEXT],
        eos_token_id=[ids[tb.IM_END], ids[tb.ENDOFTEXT]],
        pad_token_id=ids[tb.ENDOFTEXT],
        do_sample=False,
    )

    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def ensure_tiny_qwen2_vl(cache_root: Path, *, seed: int = 0, size: Qwen2VLSize = TINY) -> Path:
    """Return ``cache_root/qwen2-vl-<size.name>-<hash>``, building it once if absent.

    Safe when several processes race: each builds in its own temp dir under
    ``cache_root`` and renames it into place; ``rename`` onto an existing non-empty
    directory fails, so the loser deletes its copy and uses the winner's.
    """
    final = Path(cache_root) / f"qwen2-vl-{size.name}-{recipe_hash(seed, size)}"
    return build_once(final, lambda d: build_tiny_qwen2_vl(d, seed=seed, size=size), seed=seed)
