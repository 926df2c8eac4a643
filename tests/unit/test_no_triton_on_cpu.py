"""A fleet process on the CPU never imports triton (``shared.process.device.keep_triton_out``): imported
(torchvision imports ``torch._dynamo``, which imports triton when it is installed), triton's
nanobind types are reported as leaked when the process exits with its heap frozen
(``shared.process.gcpolicy``): pages of warnings on Ctrl-C. In a fresh interpreter, as a worker starts."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from tests.procs import REPO

SCRIPT = textwrap.dedent("""
    import sys
    from shared.process import gcpolicy
    from shared.process.device import keep_triton_out

    gcpolicy.starting()
    if sys.argv[1] == "cpu":
        keep_triton_out("cpu")
    import transformers.image_utils  # noqa: F401 - what a processor imports: torchvision, torch._dynamo
    from torch.utils._triton import has_triton_package

    print("triton", has_triton_package(), flush=True)
    gcpolicy.serving()
""")


def run(device: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", SCRIPT, device], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out


def test_a_cpu_process_exits_without_leak_reports():
    out = run("cpu")
    assert "triton False" in out.stdout
    assert "leaked" not in out.stderr, out.stderr[:2000]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed here")
def test_without_it_triton_is_imported_and_reported_at_exit():
    """What the test above guards against, where triton is installed (a dependency of xgrammar)."""
    out = run("none")
    assert "triton True" in out.stdout
    assert "nanobind: leaked" in out.stderr
