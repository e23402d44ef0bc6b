"""A NIXL agent in a child process, driven over a pipe: the transport probes' peer
(``test_probe_transport_fence.py``, ``test_probe_transport_netns.py``).

The child registers one buffer of ``blocks`` MiB filled with ``fill`` and, between commands,
progresses UCX (drains notifications, polls its WRITEs). Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvpush.demo import processes

BLOCK = 1 << 20
WAIT_S = 30.0


def descs(base: int, blocks: int) -> np.ndarray:
    return np.array([(base + i * BLOCK, BLOCK, 0) for i in range(blocks)], dtype=np.uint64)


def _main(
    conn: Connection,
    name: str,
    options: dict[str, Any],
    fill: int,
    blocks: int,
    ns: str | None,
    env: dict[str, str],
) -> None:
    os.environ.setdefault("UCX_LOG_LEVEL", "fatal")
    os.environ.update(env)
    try:
        import torch

        from kvpush.core.transport import TransferState, TransportConfig
        from kvpush.transports import tcp_fence
        from kvpush.transports.nixl import NixlTransport

        if ns is not None:
            from kvpush.demo import netns

            netns.enter(ns)
        transport = NixlTransport(TransportConfig(agent_name=name, options=options))
        buf = torch.full((BLOCK * blocks,), fill, dtype=torch.uint8)
        transport.register_buffer(buf.data_ptr(), buf.numel(), "DRAM", 0)
        local = transport.prepare_local(descs(buf.data_ptr(), blocks), "DRAM")
        conn.send(("ok", (transport.metadata(), buf.data_ptr())))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    handles: list[Any] = []
    states: list[str] = []
    try:
        while True:
            with contextlib.suppress(Exception):
                transport.drain_notifs()
            for i, handle in enumerate(handles):
                if handle is not None and states[i] == "pending":
                    state = transport.poll(handle)
                    if state is not TransferState.PENDING:
                        states[i] = state.value
            if not conn.poll(0.001):
                continue
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            try:
                if cmd == "load":
                    conn.send(("ok", transport.load_peer(args[0])))
                elif cmd == "write":  # peer, its base address, blocks, notification
                    peer, base, count, notif = args
                    remote = transport.prepare_remote(peer, descs(base, count), "DRAM")
                    ids = np.arange(count, dtype=np.int32)
                    try:
                        handles.append(transport.post_write(local, ids, remote, ids, notif))
                        states.append("pending")
                    except Exception as err:
                        handles.append(None)
                        states.append(f"raised {err}")
                    conn.send(("ok", len(handles) - 1))
                elif cmd == "abort":  # what P's core does at the WRITE deadline
                    index, peer = args
                    if states[index] == "pending":
                        transport.release(handles[index])
                        states[index] = "aborted"
                    handles[index] = None
                    transport.remove_peer(peer)
                    conn.send(("ok", states[index]))
                elif cmd == "notify":
                    transport.send_notif(args[0], args[1])
                    conn.send(("ok", None))
                elif cmd == "fence":
                    transport.fence_peer(args[0])
                    conn.send(("ok", None))
                elif cmd == "fenced":
                    conn.send(("ok", transport.fenced(args[0])))
                elif cmd == "landed":  # bytes of this agent's buffer a peer overwrote
                    conn.send(("ok", int((buf != fill).sum())))
                elif cmd == "states":
                    conn.send(("ok", list(states)))
                elif cmd == "sockets":
                    conn.send(("ok", [str(s) for s in tcp_fence.sockets()]))
                else:
                    conn.send(("error", f"unknown command {cmd!r}"))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            transport.close()


class Agent:
    """The child process; ``blob`` is its NIXL metadata, ``addr`` its buffer's address."""

    def __init__(
        self,
        name: str,
        options: dict[str, Any],
        fill: int,
        blocks: int,
        *,
        ns: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.process, self.conn = processes.start(
            _main, lambda conn: (conn, name, options, fill, blocks, ns, env or {}), name=f"agent-{name}"
        )
        self.blob, self.addr = self._reply("start")

    def _reply(self, what: str) -> Any:
        if not self.conn.poll(WAIT_S):
            raise TimeoutError(f"no answer to {what!r} within {WAIT_S}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{what!r} failed:\n{value}")
        return value

    def call(self, *message: Any) -> Any:
        self.conn.send(message)
        return self._reply(message[0])

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("stop",))
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        self.conn.close()
