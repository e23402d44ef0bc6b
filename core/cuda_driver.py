"""The few CUDA driver calls a copy launch makes, through ctypes: events, a stream's wait on
an event, and the pinned host-to-device upload of a descriptor table.

Why not torch's wrappers: on the H200 bench a launch in P's writer thread (woken from sleep
for each request) spent ~150 µs in ``torch.cuda.current_stream``, ``Event.record``,
``Stream.wait_event``, ``torch.cuda.stream(...)`` and ``Tensor.copy_`` (each a Python -> C++
binding with argument parsing), against a few µs for the driver calls underneath. Each call
here is one ctypes call with declared argument types (~1 µs). The streams stay torch's.

Every call runs on the device's primary context, the one torch's runtime uses: ``switch`` makes
it current on the calling thread when another is (or none is), and ``restore`` gives the
thread its own back (the runtime's current device follows the current context).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from kvpush.core.errors import ConfigError, TransferError

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
CU_EVENT_DISABLE_TIMING = 0x2

_void_p = ctypes.c_void_p
_SIGNATURES: dict[str, tuple[Any, ...]] = {
    "cuInit": (ctypes.c_uint,),
    "cuGetErrorName": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
    "cuDevicePrimaryCtxRetain": (ctypes.POINTER(_void_p), ctypes.c_int),
    "cuCtxGetCurrent": (ctypes.POINTER(_void_p),),
    "cuCtxSetCurrent": (_void_p,),
    "cuEventCreate": (ctypes.POINTER(_void_p), ctypes.c_uint),
    "cuEventRecord": (_void_p, _void_p),
    "cuEventQuery": (_void_p,),
    "cuEventSynchronize": (_void_p,),
    "cuEventDestroy_v2": (_void_p,),
    "cuStreamWaitEvent": (_void_p, _void_p, ctypes.c_uint),
    "cuMemcpyHtoDAsync_v2": (ctypes.c_uint64, _void_p, ctypes.c_size_t, _void_p),
}


class CudaDriver:
    """``libcuda.so.1`` with the calls above declared; one per process (:func:`driver`)."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            raise ConfigError(f"the CUDA copy path needs the CUDA driver (libcuda.so.1): {err}") from err
        for name, args in _SIGNATURES.items():
            function = getattr(lib, name)
            function.argtypes = args
            function.restype = ctypes.c_int
        self.lib = lib
        self._check(lib.cuInit(0), "cuInit")
        self._primary: dict[int, int] = {}

    def _check(self, status: int, what: str) -> None:
        if status != CUDA_SUCCESS:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(status, ctypes.byref(name))
            raise TransferError(f"CUDA {what} failed: {(name.value or b'?').decode()} ({status})")

    def primary_context(self, device: int) -> int:
        """The primary context of ``device`` (retained once; torch's runtime uses the same)."""
        ctx = self._primary.get(device)
        if ctx is None:
            handle = _void_p()
            self._check(
                self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(handle), device), "cuDevicePrimaryCtxRetain"
            )
            ctx = self._primary[device] = int(handle.value or 0)
        return ctx

    def switch(self, context: int) -> int | None:
        """Make ``context`` current on this thread; returns the context to give back with
        :meth:`restore` when another one (or none) was current, else None (nothing to undo)."""
        current = _void_p()
        self._check(self.lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        previous = current.value or 0
        if previous == context:
            return None
        self._check(self.lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")
        return previous

    def restore(self, previous: int | None) -> None:
        """Undo a :meth:`switch` (torch's current device on this thread follows the context)."""
        if previous is not None:
            self._check(self.lib.cuCtxSetCurrent(previous or None), "cuCtxSetCurrent")

    def wait_event(self, stream: int, event: int) -> None:
        """Work queued on ``stream`` from now on waits for ``event``'s latest record."""
        self._check(self.lib.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")

    def upload(self, device_addr: int, host_addr: int, nbytes: int, stream: int) -> None:
        """Queue a copy of ``nbytes`` from pinned host memory to the device on ``stream``."""
        self._check(
            self.lib.cuMemcpyHtoDAsync_v2(device_addr, host_addr, nbytes, stream), "cuMemcpyHtoDAsync"
        )


_DRIVER: CudaDriver | None = None
_DRIVER_LOCK = threading.Lock()


def driver() -> CudaDriver:
    """This process's :class:`CudaDriver` (loaded at the first call)."""
    global _DRIVER
    if _DRIVER is None:
        with _DRIVER_LOCK:
            if _DRIVER is None:
                _DRIVER = CudaDriver()
    return _DRIVER


class DriverEvent:
    """A CUDA event without timing, in ``context``: ``record``, ``query``, ``synchronize``
    (what a copy's caller uses of ``torch.cuda.Event``). Destroyed with the object."""

    __slots__ = ("_driver", "context", "handle")

    def __init__(self, context: int) -> None:
        self._driver = d = driver()
        self.context = context
        self.handle = 0
        previous = d.switch(context)
        try:
            handle = _void_p()
            d._check(d.lib.cuEventCreate(ctypes.byref(handle), CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            self.handle = int(handle.value or 0)
        finally:
            d.restore(previous)

    def record(self, stream: int) -> None:
        """Record on ``stream``, a raw stream handle of this event's context (the caller has
        that context current)."""
        self._driver._check(self._driver.lib.cuEventRecord(self.handle, stream), "cuEventRecord")

    def query(self) -> bool:
        """True once all work recorded before the event finished (or it was never recorded)."""
        d = self._driver
        previous = d.switch(self.context)
        try:
            status = d.lib.cuEventQuery(self.handle)
        finally:
            d.restore(previous)
        if status == CUDA_ERROR_NOT_READY:
            return False
        d._check(status, "cuEventQuery")
        return True

    def synchronize(self) -> None:
        """Block this thread until the event completed (ctypes releases the GIL meanwhile)."""
        d = self._driver
        previous = d.switch(self.context)
        try:
            d._check(d.lib.cuEventSynchronize(self.handle), "cuEventSynchronize")
        finally:
            d.restore(previous)

    def __del__(self) -> None:
        if not self.handle:
            return
        try:
            d = self._driver
            previous = d.switch(self.context)
            try:
                d.lib.cuEventDestroy_v2(self.handle)
            finally:
                d.restore(previous)
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass
