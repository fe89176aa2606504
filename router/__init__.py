"""The KV-aware gateway: mirror of every engine's prefix cache, lookup, scoring and the HTTP proxy."""
