"""The mirror of every engine's prefix cache, fed by KV events, and the pending overlay."""
