"""Suite-wide settings: hypothesis without per-example deadlines (the 2-core CI box is shared by
real NIXL processes; a slow example is not a failure), derandomized so CI is reproducible."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile(
    "kvpush",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("kvpush")
