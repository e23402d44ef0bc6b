"""Probes (audit): a safety mechanism that FAILS must never be taken for one that succeeded.

D gives blocks back only once nothing more can land in them: P acknowledged, P's connections
were fenced and the fence confirmed, or P's process is seen to have exited. Each probe here
makes one of those checks fail the way a real system can (a raising ``poll``, an fd table that
is full, a ``/proc`` entry this process may not read, a transport without the fence methods,
a boot id that cannot be read) and asks whether kvpush then proceeds as if the check had
succeeded: D releasing blocks a WRITE can still land in.

Harness: the in-process loopback transport with small subclasses (``DelayedTransport``: its
WRITEs land only when the test says so, like bytes in a TCP send queue or a kernel copy on a
stalled device), run through ``tests/cluster.py`` with the plugin manager swapped.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace
from typing import Any

import cluster as cluster_module
import pytest
import torch
from cluster import Cluster, kv_bytes, wait_until

import kvpush.transports.loopback as loopback
from kvpush.core import process_identity
from kvpush.core.errors import ConfigError
from kvpush.core.manager import get_plugin_manager
from kvpush.core.markers import hookimpl
from kvpush.core.receiver import PushReceiver
from kvpush.core.transport import TransferState
from kvpush.core.types import ParallelConfig, RankKey, TransportProvider
from kvpush.core.worker import WRITES_ABORTABLE_KEY, WorkerConfig
from kvpush.layouts.uniform import allocate_kv_caches

# ---------------------------------------------------------------------------- transports


class DelayedTransport(loopback.LoopbackTransport):
    """Loopback whose WRITEs are queued and land (bytes, then the DONE) only at :meth:`land`.

    Its fence is a real one for queued bytes: ``fence_peer(p)`` on the receiving side drops
    what ``p`` queued towards it (as D shutting P's sockets drops what P's kernel queued).
    ``poll_raises``: the next N polls of a queued WRITE raise (a transport whose poll breaks its
    contract); ``fail_writes``: the next N WRITEs end in error (nothing queued)."""

    name = "delayed"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.lock = threading.Lock()
        self.queued: dict[int, tuple[str, list[tuple[int, int, int]], bytes]] = {}
        self.poll_raises = 0
        self.raised = 0

    def post_write(
        self, local_list: int, local_ids: Any, remote_list: int, remote_ids: Any, notif: bytes
    ) -> int:
        peer, remote = self._lists[remote_list]
        _, local = self._lists[local_list]
        copies = [
            (int(remote[r][0]), int(local[i][0]), int(local[i][1]))
            for i, r in zip(local_ids, remote_ids, strict=True)
        ]
        handle = next(loopback._IDS)
        with self.lock:
            if self.fail_writes:
                self.fail_writes -= 1
                self._states[handle] = TransferState.FAILED
            else:
                self.queued[handle] = (str(peer), copies, notif)
                self._states[handle] = TransferState.PENDING
        self.posts.append({"peer": peer, "notif": notif})
        self.counters.writes_posted += 1
        return handle

    def land(self) -> int:
        """Every WRITE still queued lands now; returns how many did."""
        with self.lock:
            items, self.queued = list(self.queued.items()), {}
        for handle, (peer, copies, notif) in items:
            for dst, src, n in copies:
                ctypes.memmove(dst, src, n)
            target = loopback._AGENTS.get(peer)
            if target is not None:
                target.inbox.append((self.agent_name, notif))
            with self.lock:
                if handle in self._states:
                    self._states[handle] = TransferState.DONE
        return len(items)

    def poll(self, handle: int) -> TransferState:
        with self.lock:
            if self.poll_raises and self._states.get(handle) is TransferState.PENDING:
                self.poll_raises -= 1
                self.raised += 1
                raise RuntimeError("transient error while querying the transfer (injected)")
            return self._states.get(handle, TransferState.FAILED)

    def fence_peer(self, peer: str) -> None:
        self.remove_peer(peer)
        sender = loopback._AGENTS.get(peer)
        if isinstance(sender, DelayedTransport):
            with sender.lock:
                for handle in [h for h, q in sender.queued.items() if q[0] == self.agent_name]:
                    del sender.queued[handle]


class KernelCopyTransport(DelayedTransport):
    """A same-process-copy transport done right by the docs: its WRITEs are kernels nothing
    takes back (``writes_abortable`` False, ``abortable`` False), so neither P's deadline nor
    D's fence stops a launched one."""

    name = "kernel"
    writes_abortable = False

    def abortable(self, handle: Any) -> bool:
        return False

    def fence_peer(self, peer: str) -> None:
        self.remove_peer(peer)  # no connection carries a kernel copy: nothing to drop


class HalfDeclaredKernelTransport(DelayedTransport):
    """Publishes ``writes_abortable: false`` (its copies are kernels nothing takes back) but has
    no per-handle ``abortable()``, an optional method docs/plugins.md does not mention."""

    name = "halfkernel"
    writes_abortable = False

    def fence_peer(self, peer: str) -> None:
        self.remove_peer(peer)  # no connection carries a kernel copy: nothing to drop


class NoFenceTransport:
    """A third-party transport written before the fence existed: everything but
    ``fence_peer``/``fenced`` (its WRITEs, like any network transport's, may sit in a queue)."""

    def __init__(self, config: Any) -> None:
        self._inner = DelayedTransport(config)

    def __getattr__(self, name: str) -> Any:
        if name in ("fence_peer", "fenced"):
            raise AttributeError(name)
        return getattr(self._inner, name)


class _Transports:
    @staticmethod
    @hookimpl
    def kvpush_transports() -> list[TransportProvider]:
        return [
            TransportProvider(name="delayed", create=DelayedTransport, description="probe"),
            TransportProvider(name="kernel", create=KernelCopyTransport, description="probe"),
            TransportProvider(name="nofence", create=NoFenceTransport, description="probe"),
            TransportProvider(name="halfkernel", create=HalfDeclaredKernelTransport, description="probe"),
        ]


def _pm() -> Any:
    return get_plugin_manager(
        load_entrypoints=False,
        plugins=[("loopback", loopback), ("probe_transports", _Transports())],
    )


@pytest.fixture
def probe_pm(monkeypatch: pytest.MonkeyPatch) -> Any:
    pm = _pm()
    monkeypatch.setattr(cluster_module, "get_plugin_manager", lambda **_: pm)
    return pm


def _released_within(c: Cluster, rid: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        c.poll()
        if rid in c.released[0]:
            return True
        time.sleep(0.005)
    return False


def _inner(transport: Any) -> DelayedTransport:
    return transport._inner if isinstance(transport, NoFenceTransport) else transport


# ---------------------------------------------------------------------------- finding 1


def test_a_raising_poll_of_a_kernel_copy_never_lets_d_release_while_it_runs(probe_pm: Any) -> None:
    with Cluster(transport="kernel", request_timeout_s=60) as c:
        p = _inner(c.senders[RankKey(0, 0)].transport)
        p.poll_raises = 1
        c.add("d-1", [[1]], "x-1")
        c.finish("p-1", [[2]], "x-1")
        wait_until(lambda: p.raised == 1, 5, "P's poll of the copy to raise")
        assert p.queued, "the copy is still running"
        released_early = _released_within(c, "d-1", 1.0)
        landed = p.land()  # the kernel copy ends now: its bytes land in D's block 1
        assert landed == 1
        assert not released_early, "D released block 1 while P's kernel copy into it still ran"
        assert c.wait_decode("d-1", timeout_s=5)[0] is None  # the copy completed: done


def test_a_raising_poll_of_an_abortable_write_is_fenced_before_release(probe_pm: Any) -> None:
    """Held: for an abortable (network) WRITE a raising poll is taken as failed, D is told the
    WRITE ended unsettled and fences P before it releases; nothing queued lands afterwards."""
    with Cluster(transport="delayed", request_timeout_s=60) as c:
        p = c.senders[RankKey(0, 0)].transport
        p.poll_raises = 1
        before = kv_bytes(c.d_caches[0]["layers.0"]).clone()
        c.add("d-1", [[1]], "x-1")
        c.finish("p-1", [[2]], "x-1")
        assert c.wait_decode("d-1", timeout_s=5)[0] is not None
        c.wait_released("d-1", timeout_s=5)
        assert p.land() == 0  # the fence dropped what P had queued for D
        assert torch.equal(kv_bytes(c.d_caches[0]["layers.0"]), before)


# ---------------------------------------------------------------------------- finding 2


def test_a_decode_transport_without_the_fence_is_refused_or_never_releases(probe_pm: Any) -> None:
    parallel = ParallelConfig(tp_size=1, tp_rank=0, num_layers=4)
    probe = PushReceiver(
        WorkerConfig(
            engine_id="Dprobe",
            parallel=parallel,
            model=cluster_module.MHA,
            transport="nofence",
            side_channel_port=1,
        ),
        allocate_kv_caches(cluster_module.MHA, parallel, 8),
        pm=probe_pm,
    )
    try:
        probe.start()
    except ConfigError as err:  # refused at start: safe
        assert "fence" in str(err)
        return
    finally:
        probe.close()
    with Cluster(transport="nofence", request_timeout_s=60, write_deadline_s=0.3) as c:
        p = _inner(c.senders[RankKey(0, 0)].transport)
        c.add("d-1", [[1]], "x-1")
        c.finish("p-1", [[2]], "x-1")
        wait_until(lambda: bool(p.queued), 5, "P's WRITE to be queued")
        # P aborts at its deadline and tells D the WRITE ended unsettled; D "fences".
        released_early = _released_within(c, "d-1", 2.0)
        p.land()  # the queued bytes arrive (TCP retransmits them after the outage)
        assert not released_early, "D released block 1 with P's WRITE into it still queued"


@pytest.mark.parametrize("method", ["fence_peer", "fenced"])
def test_a_fence_that_raises_holds_the_blocks(
    probe_pm: Any, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """Held: a ``fence_peer`` that raises leaves the fence unregistered, so it is never
    confirmed, and a ``fenced()`` that raises is never a confirmation: the blocks stay held (the
    engine has the failure)."""
    with Cluster(transport="delayed", request_timeout_s=60, close_timeout_s=0.1) as c:
        d = c.receivers[0].transport

        def broken(peer: str) -> Any:
            raise RuntimeError(f"{method} failed (injected)")

        monkeypatch.setattr(d, method, broken)
        c.senders[RankKey(0, 0)].transport.fail_writes = 1  # P says: ended unsettled
        c.add("d-1", [[1]], "x-1")
        c.finish("p-1", [[2]], "x-1")
        assert c.wait_decode("d-1", timeout_s=5)[0] is not None
        assert not _released_within(c, "d-1", 0.5)
        assert c.receivers[0].stats["fences"] >= 1


# ---------------------------------------------------------------------------- finding 3


def _deny_stat(monkeypatch: pytest.MonkeyPatch, pid: int, error: OSError) -> None:
    """Reading ``/proc/<pid>/stat`` fails with ``error`` (what hidepid gives another user)."""
    real_open = open

    def fake_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) == f"{process_identity.PROC}/{pid}/stat":
            raise error
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(process_identity, "open", fake_open, raising=False)


def test_has_exited_never_says_exited_when_proc_denies_access(monkeypatch: pytest.MonkeyPatch) -> None:
    me = process_identity.this_process()
    _deny_stat(monkeypatch, os.getpid(), PermissionError(13, "Permission denied"))
    assert process_identity.has_exited(me) is not True


def test_has_exited_never_says_exited_for_a_hidden_live_process(monkeypatch: pytest.MonkeyPatch) -> None:
    me = process_identity.this_process()
    _deny_stat(monkeypatch, os.getpid(), FileNotFoundError(2, "No such file or directory"))
    assert process_identity.has_exited(me) is not True


def test_has_exited_still_sees_a_reaped_process_exit() -> None:
    """Held (and must stay so under the fix): a process that exited and was reaped is exited."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with open(f"/proc/{child.pid}/stat") as f:
            text = f.read()
        start = int(text[text.rfind(")") + 2 :].split()[19])
        identity = {**process_identity.this_process(), "pid": child.pid, "start": start}
        assert process_identity.has_exited(identity) is False
    finally:
        child.kill()
        child.wait(timeout=5)
    assert process_identity.has_exited(identity) is True


# ---------------------------------------------------------------------------- finding 4

_EMFILE_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, socket, time
    from kvpush.transports import tcp_fence
    from kvpush.transports.nixl import NixlTransport, _Fence

    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(8)
    cli = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    cli.sendall(b"x" * 4096)  # P's bytes, not read yet by D's UCX
    time.sleep(0.2)
    inode = os.fstat(conn.fileno()).st_ino
    own = [srv.getsockname()]
    assert tcp_fence.shut_down([inode]) == [inode]  # D's fence_peer shut the connection
    time.sleep(0.1)
    t = object.__new__(NixlTransport)  # only the fence state fenced() reads
    t._fences = {"P": _Fence([inode], 0, time.monotonic())}
    t._drains = 1
    t._peer_listeners = {"P": [("127.0.0.1", 1)]}
    t._tcp_listeners = own
    t._peers = set()
    t._unremoved = set()  # (the fix's: peers whose agent removal failed)

    def attempt(f):
        try:
            return repr(f())
        except OSError:
            return "OSError"

    out = {"before": attempt(lambda: t.fenced("P")),
           "complete_before": attempt(lambda: tcp_fence.fence_complete([inode])),
           "found_before": attempt(lambda: inode in [s.inode for s in tcp_fence.peer_sockets(None, own)])}
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
    fds = []
    try:
        while True:
            fds.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    out["complete_full"] = attempt(lambda: tcp_fence.fence_complete([inode]))
    out["found_full"] = attempt(lambda: inode in [s.inode for s in tcp_fence.peer_sockets(None, own)])
    out["fenced_full"] = attempt(lambda: t.fenced("P"))
    for fd in fds:
        os.close(fd)
    out["unread"] = conn.recv(65536, socket.MSG_PEEK | socket.MSG_DONTWAIT).__len__()
    print(json.dumps(out))
    """
)


def _emfile_probe() -> dict[str, str]:
    run = subprocess.run([sys.executable, "-c", _EMFILE_SCRIPT], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_emfile_probe_sees_an_unconfirmed_fence_with_fds_to_spare() -> None:
    """Held (the probe's baseline): a shut socket still holding P's unread bytes is no
    confirmed fence while the process can open files."""
    out = _emfile_probe()
    assert out["before"] == "False" and out["complete_before"] == "False"
    assert out["found_before"] == "True"
    assert int(out["unread"]) > 0


def test_a_full_fd_table_never_confirms_a_fence() -> None:
    out = _emfile_probe()
    assert out["fenced_full"] in ("False", "OSError"), out
    assert out["complete_full"] in ("False", "OSError"), out
    assert out["found_full"] in ("True", "OSError"), out


# ---------------------------------------------------------------------------- finding 5


def test_a_same_host_p_with_an_unreadable_boot_id_is_still_held() -> None:
    fake = SimpleNamespace(transport=SimpleNamespace(same_host_copies=True))
    identity = {"host": f"{socket.gethostname()}/?", "pidns": "x", "pid": 1, "start": 1}
    abortable = PushReceiver._writes_abortable(
        fake, {WRITES_ABORTABLE_KEY: True}, ["P-prefill-pp0-tp0"], {"P-prefill-pp0-tp0": identity}
    )
    assert abortable is False


# ---------------------------------------------------------------------------- finding 6

_REMOVAL_SCRIPT = textwrap.dedent(
    """
    import json, os
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    from kvpush.core.transport import TransportConfig
    from kvpush.transports.nixl import NixlTransport

    d = NixlTransport(TransportConfig(agent_name="audit-fence-d"))
    p = NixlTransport(TransportConfig(agent_name="audit-fence-p"))
    name = d.load_peer(p.metadata())
    real = d._agent.remove_remote_agent

    def broken(peer):
        raise RuntimeError("disconnecting the endpoints failed (injected)")

    d._agent.remove_remote_agent = broken
    d.fence_peer(name)
    d.drain_notifs()
    d.drain_notifs()
    out = {"while_failing": d.fenced(name)}
    d._agent.remove_remote_agent = real
    d.drain_notifs()
    out["after_retry"] = d.fenced(name)
    print(json.dumps(out))
    d.close()
    p.close()
    """
)


def test_a_fence_whose_agent_removal_failed_is_not_confirmed() -> None:
    pytest.importorskip("nixl")
    run = subprocess.run([sys.executable, "-c", _REMOVAL_SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["while_failing"] is False, out
    assert out["after_retry"] is True, out  # removed on a later try: confirmed then


# ---------------------------------------------------------------------------- finding 7


def test_a_transport_publishing_unabortable_writes_is_never_aborted_by_default(probe_pm: Any) -> None:
    with Cluster(transport="halfkernel", request_timeout_s=60, write_deadline_s=0.3) as c:
        p = c.senders[RankKey(0, 0)].transport
        c.add("d-1", [[1]], "x-1")
        c.finish("p-1", [[2]], "x-1")
        wait_until(lambda: bool(p.queued), 5, "P's copy to start")
        released_early = _released_within(c, "d-1", 1.5)  # P's deadline passes meanwhile
        assert p.land() == 1  # the copy ends now: its bytes land in D's block 1
        assert not released_early, "D released block 1 while P's kernel copy into it still ran"
        assert c.wait_decode("d-1", timeout_s=5)[0] is None  # P waited for it: done
