"""KV memory that legacy CUDA IPC cannot export (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments``).

PyTorch's expandable segments (and any ``cuMemCreate``/``cuMemMap`` allocator) back tensors with
memory ``cuIpcGetMemHandle`` refuses (``CUDA_ERROR_INVALID_VALUE``). The cuda_ipc transport used
to raise that bare driver error from ``handshake_payload()`` in every mode, so an engine with a
common allocator setting could not start with the default transport option. Now ``auto`` publishes
no IPC handles (peers write to this rank over the inner transport, which registers such memory
fine, and say why), and ``ipc`` refuses at start naming the allocator and the fix.

On the CPU the driver is a stand-in (pure logic); on a GPU a real expandable-segments tensor is
exported in a child process (the allocator setting must precede CUDA's first use).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvpush.core.errors import ConfigError, TransferError
from kvpush.core.transport import TransportConfig
from kvpush.transports import cuda_ipc
from kvpush.transports.cuda_ipc import CudaIpcTransport, decode_blob


class UnexportableDriver:
    """A driver whose memory is VMM-backed: ranges resolve, IPC export fails as CUDA's does."""

    def bind(self, device: int) -> None:
        pass

    def allocation(self, addr: int) -> tuple[int, int]:
        return addr, 4096

    def export(self, base: int) -> bytes:
        raise TransferError("CUDA cuIpcGetMemHandle failed: CUDA_ERROR_INVALID_VALUE (1)")


def transport(mode: str) -> CudaIpcTransport:
    t = CudaIpcTransport(
        TransportConfig(agent_name=f"D-{os.urandom(3).hex()}", options={"inner": "loopback", "mode": mode})
    )
    t._spans = [(4096, 4096, 0)]  # as if VRAM were registered
    t._driver = UnexportableDriver()  # type: ignore[assignment]
    return t


def test_auto_mode_publishes_no_handles_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_ipc, "device_uuids", lambda: ["gpu-0"])
    d = transport("auto")
    _inner, info = decode_blob(d.metadata())
    assert info is not None and info["allocations"] == []
    assert "cuIpcGetMemHandle" in info["unexported"] and "expandable_segments" in info["unexported"]

    p = transport("auto")
    monkeypatch.setattr(cuda_ipc, "host_identity", lambda: info["host"])
    name = p.load_peer(d.metadata())
    assert name == d.agent_name and not p.ipc_peer(name)
    assert "cannot export its KV memory over CUDA IPC" in p.fallbacks[name]


def test_ipc_mode_refuses_at_start_naming_the_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_ipc, "device_uuids", lambda: ["gpu-0"])
    with pytest.raises(ConfigError, match=r"expandable_segments.*mode 'auto'"):
        transport("ipc").metadata()


CHILD = """
import os, torch
from kvpush.core.transport import TransportConfig
from kvpush.core.types import KVRegion
from kvpush.transports.cuda_ipc import CudaIpcTransport, decode_blob
t = torch.zeros(1 << 20, device="cuda:0")
tr = CudaIpcTransport(TransportConfig(agent_name="x-" + os.urandom(3).hex(), options={"mode": "auto"}))
tr._spans = [(t.data_ptr(), t.numel() * 4, 0)]
_, info = decode_blob(tr.metadata())
print("ALLOCATIONS", len(info["allocations"]), "UNEXPORTED", bool(info.get("unexported")))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("expandable", [False, True])
def test_a_real_allocation_is_exported_or_named_unexportable(expandable: bool) -> None:
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    expected = "ALLOCATIONS 0 UNEXPORTED True" if expandable else "ALLOCATIONS 1 UNEXPORTED False"
    assert expected in out.stdout, out.stdout + out.stderr[-2000:]
