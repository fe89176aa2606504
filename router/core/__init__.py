"""The router's pure core: block keys, the mirror, the vLLM-exact lookup and the policy.

No sockets, no asyncio, no clock read anywhere beneath it (time is passed in); tests/test_layering.py
walks its imports transitively to keep it so."""
