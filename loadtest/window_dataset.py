"""The sliding-window workload as a dataset vLLM's own benchmark client replays, and that run.

``write(specs, out)``: every image once as a PNG under ``out/images`` and one JSONL line per
request, in our run order (turn-major), as vLLM's ``custom_image`` dataset reads it
(``{"prompt", "image_files", "output_tokens"}``; that loader takes the output length from
``--custom-output-len``, so the workload's must be one length). ``run_client`` replays it against an endpoint
(``--disable-shuffle``, ``--max-concurrency`` = users, images sent as data URLs by the client):
vLLM's client has no sessions, so with as many requests in flight as users a user's next turn
may start before its previous one ends; ours keeps each user's turns in sequence.
Design: docs/benchmarks/window.md.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from loadtest.images import image_bytes
from loadtest.targets import Endpoint, find_vllm_python
from loadtest.workloads import RequestSpec


def write(specs: list[RequestSpec], out: Path) -> Path:
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    path = out / "sliding-window.jsonl"
    with open(path, "w") as f:
        for spec in specs:
            [msg] = spec.messages
            files = []
            for img in msg.images:
                file = images / img.name
                if not file.exists():
                    file.write_bytes(image_bytes(img))
                files.append(str(file))
            f.write(json.dumps({"prompt": msg.text, "image_files": files, "output_tokens": spec.max_tokens}) + "\n")
    return path


def client_argv(base_url: str, dataset: Path, *, model: str, tokenizer: Path, users: int, num_prompts: int,
                output_len: int, result_dir: Path, result_file: str) -> list[str]:
    return ["--backend", "openai-chat", "--base-url", base_url, "--endpoint", "/v1/chat/completions",
            "--model", model, "--tokenizer", str(tokenizer), "--dataset-name", "custom_image",
            "--dataset-path", str(dataset), "--disable-shuffle", "--custom-ensure-client-side-data",
            "--custom-output-len", str(output_len), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(users), "--seed", "0",
            "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", result_file, "--disable-tqdm"]


def run_client(ep: Endpoint, dataset: Path, *, model: str, tokenizer: Path, users: int, num_prompts: int,
               output_len: int, out_dir: Path, tag: str, timeout_s: float = 900) -> dict:
    """vLLM's result for one replay (``{"error": ...}`` if it failed)."""
    slug = ep.name.replace(":", "-").replace(",", "_").replace("=", "-") + tag
    name = f"vllm-client-window-{slug}.json"
    argv = [find_vllm_python(), "-m", "loadtest.vllmclient", *client_argv(
        ep.base_url, dataset, model=model, tokenizer=tokenizer, users=users, num_prompts=num_prompts,
        output_len=output_len, result_dir=out_dir, result_file=name)]
    log_path = out_dir / "logs" / f"vllm-client-window-{slug}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    path = out_dir / name
    if proc.returncode != 0 or not path.exists():
        return {"error": f"vLLM's client exited {proc.returncode}; see {log_path}"}
    return json.loads(path.read_text())
