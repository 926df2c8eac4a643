"""A Qwen2-VL's compute split, in one process: ``python -m loadtest split`` (or ``python -m loadtest.split``).

Model compute only: ``encode`` (one ``--image-side``² image; 448² → 256 LM tokens), ``prefill``
(its tokens + ``--text-tokens``), ``ttft`` = their sum and ``encode_share``, ``decode`` (one
token, mean over ``--decode-tokens``), ``long_prefill`` (a ``--long-tokens`` multi-turn prompt)
and ``suffix_prefill`` (that prompt past ``--cached-tokens`` cached: what a prefix hit saves).
Each ``--repeats`` times interleaved, ratios per repeat, median and range. ``--model-dir`` /
``--demo-model`` measure a built model as a fleet worker runs it; ``--arch qwen2-vl-2b`` builds
the real shapes with random weights on ``--device``. Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from loadtest.repeats import spread

# Qwen2-VL-2B-Instruct's config.json (vision 675 M params, LM 1.5 B): the shapes only
ARCH_2B = {
    "text_config": {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                    "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768,
                    "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24],
                                        "rope_theta": 1000000.0}},
    "vision_config": {"depth": 32, "embed_dim": 1280, "hidden_size": 1536, "num_heads": 16, "mlp_ratio": 4,
                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3},
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model-dir", help="a saved Qwen2-VL model directory")
    src.add_argument("--demo-model", default="qwen2-vl:bench", help="a demo model (default qwen2-vl:bench)")
    src.add_argument("--arch", choices=["qwen2-vl-2b"], help="real shapes, random weights")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads on cpu (a fleet worker runs 1)")
    p.add_argument("--image-side", type=int, default=448)
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--long-tokens", type=int, default=2048)
    p.add_argument("--cached-tokens", type=int, default=1536,
                   help="of the long prompt, positions whose KV is cached for the suffix prefill (0: skip it)")
    p.add_argument("--layers", type=int, help="with --arch: build only this many LM and vision layers")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _load(args):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    if args.arch:
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        cfg = {**ARCH_2B, "text_config": dict(ARCH_2B["text_config"]), "vision_config": dict(ARCH_2B["vision_config"])}
        if args.layers:
            cfg["text_config"]["num_hidden_layers"] = cfg["vision_config"]["depth"] = args.layers
        with torch.device(args.device):
            model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(**cfg)).to(dtype)
        return model.eval(), args.arch + (f" ({args.layers} layers)" if args.layers else "")
    path = args.model_dir
    if not path:
        from shared.models.registry import resolve_model_path
        from shared.settings import Settings

        path = resolve_model_path(Settings(demo_model=args.demo_model))
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).to(args.device)
    return model.eval(), str(path)


def measure(model, *, device: str, image_side: int, text_tokens: int, long_tokens: int, decode_tokens: int,
            repeats: int, cached_tokens: int = 0) -> dict:
    """Times in ms per repeat (see the module contract); ``model`` is a Qwen2VLForConditionalGeneration."""
    from transformers import DynamicCache

    vc, tc = model.config.vision_config, model.config.text_config
    dtype = next(model.parameters()).dtype
    side = image_side // vc.patch_size
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randn(side * side, patch_dim, generator=gen).to(device, dtype)
    grid = torch.tensor([[1, side, side]], device=device)
    image_tokens = side * side // vc.spatial_merge_size ** 2
    short = torch.randn(1, image_tokens + text_tokens, tc.hidden_size, generator=gen).to(device, dtype)
    long = torch.randn(1, long_tokens, tc.hidden_size, generator=gen).to(device, dtype)

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def timed(fn):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        return (time.perf_counter() - t) * 1e3, out

    def prefill(embeds, cache=None, start=0):
        n = embeds.shape[1]
        pos = torch.arange(start, start + n, device=device).view(1, 1, -1).expand(4, 1, -1)
        return model(inputs_embeds=embeds, position_ids=pos,
                     past_key_values=cache if cache is not None else DynamicCache(config=model.config),
                     use_cache=True, logits_to_keep=1)

    def cached_prefix():  # the KV of the long prompt's first cached_tokens positions
        cache = DynamicCache(config=model.config)
        prefill(long[:, :cached_tokens], cache)
        return cache

    def decode(cache, n0):
        for i in range(decode_tokens):
            pos = torch.full((4, 1, 1), n0 + i, device=device)
            model(input_ids=torch.tensor([[7]], device=device), position_ids=pos, past_key_values=cache,
                  use_cache=True)

    runs = []
    with torch.inference_mode():
        for r in range(repeats + 1):  # the first is a warm-up
            enc, _ = timed(lambda: model.model.get_image_features(pixels, grid))
            pre, out = timed(lambda: prefill(short))
            dec, _ = timed(lambda cache=out.past_key_values: decode(cache, short.shape[1]))
            lpre, _ = timed(lambda: prefill(long))
            run = {"encode_ms": enc, "prefill_ms": pre, "decode_ms_per_token": dec / decode_tokens,
                   "long_prefill_ms": lpre}
            if 0 < cached_tokens < long_tokens:
                prefix = cached_prefix()  # untimed: only the suffix's prefill is measured
                run["suffix_prefill_ms"], _ = timed(lambda: prefill(long[:, cached_tokens:], prefix, cached_tokens))
                run["long_over_suffix"] = lpre / run["suffix_prefill_ms"]
            if r:
                runs.append(run)
    for x in runs:
        x["ttft_ms"] = x["encode_ms"] + x["prefill_ms"]
        x["encode_share"] = x["encode_ms"] / x["ttft_ms"]
        x["decode_over_ttft"] = x["decode_ms_per_token"] / x["ttft_ms"]
        x["long_prefill_share"] = x["long_prefill_ms"] / (x["encode_ms"] + x["long_prefill_ms"])
    summary = spread(runs)
    params = {"vision": sum(p.numel() for n, p in model.named_parameters() if "visual" in n),
              "language": sum(p.numel() for n, p in model.named_parameters() if "visual" not in n)}
    return {"image_side": image_side, "image_tokens": image_tokens, "prompt_tokens": short.shape[1],
            "long_tokens": long_tokens, "cached_tokens": cached_tokens if "long_over_suffix" in summary else 0,
            "decode_tokens": decode_tokens, "repeats": repeats,
            "params": params, "summary": summary, "runs": runs}


def markdown(name: str, device: str, res: dict) -> str:
    s = res["summary"]

    def f(k, pct=False):
        m, lo, hi = s[k]["median"], s[k]["min"], s[k]["max"]
        return f"{m:.0%} ({lo:.0%}–{hi:.0%})" if pct else f"{m:.1f} ({lo:.1f}–{hi:.1f})"

    return (f"| {name} | {device} | {f('encode_ms')} | {f('prefill_ms')} | {f('decode_ms_per_token')} | "
            f"{f('encode_share', True)} | {f('long_prefill_ms')} | {f('long_prefill_share', True)} | "
            f"{f('decode_over_ttft', True)} |")


def header(long_tokens: int) -> str:
    return ("| model | device | encode ms | prefill ms | decode ms/token | encode share of TTFT | "
            f"{long_tokens}-token prefill ms | its share of TTFT | decode / TTFT |\n"
            "|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="loadtest split", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    model, name = _load(args)
    res = measure(model, device=args.device, image_side=args.image_side, text_tokens=args.text_tokens,
                  long_tokens=args.long_tokens, decode_tokens=args.decode_tokens, repeats=args.repeats,
                  cached_tokens=args.cached_tokens)
    res["model"], res["device"] = name, args.device
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"{args.image_side}² image ({res['image_tokens']} tokens) + {args.text_tokens} text tokens; "
              f"{args.long_tokens}-token prefill; median (min–max) of {args.repeats}\n")
        print(header(args.long_tokens))
        print(markdown(name.rsplit("/", 1)[-1], args.device, res))
        if res["cached_tokens"]:
            s = res["summary"]
            print(f"\nthe {args.long_tokens}-token prompt with its first {res['cached_tokens']} positions cached: "
                  f"{s['suffix_prefill_ms']['median']:.1f} ms ({s['suffix_prefill_ms']['min']:.1f}–"
                  f"{s['suffix_prefill_ms']['max']:.1f}); full ÷ cached-suffix prefill "
                  f"{s['long_over_suffix']['median']:.2f} ({s['long_over_suffix']['min']:.2f}–"
                  f"{s['long_over_suffix']['max']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
