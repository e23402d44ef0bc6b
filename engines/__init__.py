"""Engine integrations: glue between an inference engine and kvpush's public API.

Each module imports its engine lazily (only when used); nothing else in kvpush imports this
package, so ``import kvpush`` never pulls an engine in.
"""
