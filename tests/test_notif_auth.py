"""Issue 10.6: with a shared secret, notifications carry a MAC bound to sender, receiver and the
receiver's incarnation; a process that never passed the handshake can neither complete, fail,
cancel nor register."""

from __future__ import annotations

from cluster import Cluster, settle, wait_until
from test_push_flow import assert_pushed

from kvpush.core import notif_auth, notifications
from kvpush.core.types import RankKey

SECRET = "s3cret-for-tests"


def test_push_works_with_a_secret_and_unauthenticated_notifications_are_dropped() -> None:
    with Cluster(prefill_pp=2, secret=SECRET, request_timeout_s=60) as cluster:
        receiver = cluster.receivers[0]
        cluster.add("d-1", [[1, 2]], "x-1")
        wait_until(lambda: receiver.stats["push_regs_sent"] == 2, what="PUSH_REG to both stages")
        done = notifications.encode_done("d-1", RankKey(0, 0), 1)
        forged = [
            done,  # no MAC at all
            notif_auth.seal(
                notif_auth.derive_key(b"wrong"),
                "P-prefill-pp0-tp0",
                receiver.agent_name,
                receiver.incarnation,
                done,
            ),  # another secret
            notif_auth.seal(
                notif_auth.derive_key(SECRET.encode()),
                "P-prefill-pp0-tp0",
                "someone-else",
                receiver.incarnation,
                done,
            ),  # meant for another agent
            notif_auth.seal(
                notif_auth.derive_key(SECRET.encode()),
                "P-prefill-pp0-tp0",
                receiver.agent_name,
                "an-older-start",
                done,
            ),  # a replay from before a restart
        ]
        for frame in forged:
            receiver.transport.inject("P-prefill-pp0-tp0", frame)
        settle(receiver)
        assert receiver.unauthenticated_notifications == len(forged)
        assert receiver.get_finished().done == ()
        cluster.finish("p-1", [[5, 6]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        assert_pushed(cluster, [5, 6], [1, 2])


def test_a_decode_without_the_secret_cannot_register() -> None:
    with Cluster(secret=SECRET, request_timeout_s=60, handshake_timeout_s=1.0) as cluster:
        sender = cluster.senders[RankKey(0, 0)]
        receiver = cluster.receivers[0]
        receiver._mac_key = None  # this D rank speaks without the secret
        cluster.add("d-1", [[1]], "x-1")
        reason = cluster.wait_decode("d-1", timeout_s=10)[0]
        assert reason is not None and "HELLO" in reason  # P never answered: it dropped the HELLO
        assert sender.unauthenticated_notifications >= 1
        assert sender.core.state_sizes()["requests"] == 0
