"""Transport plugins: NIXL, and a fault-injecting wrapper."""
