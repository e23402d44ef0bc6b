"""The P/D state machine of ``tests/test_core_properties.py`` with one more thing the engines do:
add a request again under a match key while the first request of the key is still waited for
on D (a router sending one request twice, vLLM's n>1 children sharing one ``transfer_id``), and
cancel either. Two live D registrations of one rank under one key: P writes one of them, tells
the other, and renews each only on its own PUSH_REG. The cluster's checks are unchanged: no byte
outside the blocks D offers, done means every producer's WRITE landed, one report per request,
every handle settled, everything drains.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import precondition, rule
from test_core_properties import EXAMPLES, IDX, CoreCluster, KernelCopyCluster


class _SameKeyTwice:
    @precondition(lambda self: self.requests and self.live_d())
    @rule(i=IDX)
    def add_again_under_the_same_key(self, i: int) -> None:
        """D's engine adds another request under a key one of its requests still waits for."""
        old = self.requests[i % len(self.requests)]
        if not any(old.rid in d.requests and not d.requests[old.rid].outcomes for d in self.live_d()):
            return  # not waited for any more: the retry rule's case
        n = next(self.seq)
        req = attrs.evolve(old, rid=f"{old.rid.split('#')[0]}#{n}", seq=n)
        self.requests.append(req)
        for d in self.live_d():
            self._add(d, req)


class SameKeyCluster(_SameKeyTwice, CoreCluster):
    pass


class SameKeyKernelCopyCluster(_SameKeyTwice, KernelCopyCluster):
    pass


_SETTINGS = {
    "stateful_step_count": 40,
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
}
SameKeyCluster.TestCase.settings = settings(max_examples=max(50, EXAMPLES // 2), **_SETTINGS)
SameKeyKernelCopyCluster.TestCase.settings = settings(max_examples=max(30, EXAMPLES // 8), **_SETTINGS)
TestSameKeyCluster = pytest.mark.timeout(600)(SameKeyCluster.TestCase)
TestSameKeyKernelCopyCluster = pytest.mark.timeout(600)(SameKeyKernelCopyCluster.TestCase)
