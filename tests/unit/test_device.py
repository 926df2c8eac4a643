"""Device placement settings and the GPU fields of a tensor descriptor, on a CPU machine."""

from __future__ import annotations

import msgspec
import pytest
import torch

from shared.process.device import host_id, resolve_placement
from shared.protocol import CudaIpcHandle, TensorRef
from shared.transfer import cuda_ipc
from shared.transfer.tensors import as_bytes


def test_cpu_placement_defaults_to_float32() -> None:
    p = resolve_placement("cpu", "auto")
    assert p.device == torch.device("cpu") and p.dtype == torch.float32 and not p.is_cuda
    assert resolve_placement("CPU", "bfloat16").dtype == torch.bfloat16


@pytest.mark.parametrize("device, dtype, message", [
    ("gpu", "auto", "cpu, cuda or cuda:N"), ("cuda:x", "auto", "cpu, cuda or cuda:N"),
    ("cpu", "fp8", "dtype must be"),
])
def test_bad_placement_is_refused(device, dtype, message) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_placement(device, dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_cuda_without_a_gpu_is_an_error_not_a_cpu_fallback() -> None:
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        resolve_placement("cuda")


def test_tensor_ref_gpu_fields_default_and_round_trip() -> None:
    old = msgspec.msgpack.encode({"agent": "a", "addr": 4096, "nbytes": 8, "device_id": 0, "lease": 1,
                                  "dtype": "float32", "shape": [2]})
    ref = msgspec.msgpack.decode(old, type=TensorRef)  # a message from a worker before this change
    assert (ref.mem, ref.on_device, ref.cuda_ipc) == ("DRAM", False, None)
    h = CudaIpcHandle(host=host_id(), device_uuid="GPU-x", handle=b"\x01" * 64, storage_bytes=8, offset_bytes=0,
                      ref_counter_handle=b"rc", ref_counter_offset=3, event_handle=b"", event_sync_required=False)
    full = msgspec.structs.replace(ref, on_device=True, cuda_ipc=h)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(full), type=TensorRef) == full


def test_ipc_handle_of_another_host_or_gpu_is_not_opened() -> None:
    h = CudaIpcHandle(host="elsewhere/boot", device_uuid="GPU-x", handle=b"", storage_bytes=8, offset_bytes=0,
                      ref_counter_handle=b"", ref_counter_offset=0, event_handle=b"", event_sync_required=False)
    assert not cuda_ipc.can_open(h)
    assert not cuda_ipc.can_open(msgspec.structs.replace(h, host=host_id()))  # no such GPU here
    with pytest.raises(cuda_ipc.IpcError):
        cuda_ipc.IpcPeers().copy("owner", h, 8, torch.uint8, (8,))


def test_as_bytes_takes_cpu_and_refuses_other_devices() -> None:
    flat, name = as_bytes(torch.arange(6, dtype=torch.int32).reshape(2, 3))
    assert flat.dtype == torch.uint8 and flat.numel() == 24 and name == "int32"
    with pytest.raises(ValueError, match="CPU or CUDA"):
        as_bytes(torch.empty(2, device="meta"))
