"""The one project name, and the pluggy markers made from it."""

from __future__ import annotations

import pluggy

PROJECT_NAME = "kvpush"
"""Used for the hook markers, the plugin manager and the entry-point group."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Decorate plugin functions with this: ``from kvpush import hookimpl``."""
