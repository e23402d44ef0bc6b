"""`kvpush demo`: real processes pushing real KV over NIXL, verified byte for byte."""
