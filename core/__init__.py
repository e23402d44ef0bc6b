"""The kvpush core: hook specs, plugin manager facade, data model, side channel and workers."""
