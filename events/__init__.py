"""The KV-event link: vLLM 0.33.0 wire format, framing, sequence tracking, publisher, subscriber, recordings.

Imports nothing from router/ or engine_stub/.
"""
