"""The stub's vLLM-faithful core, pure, its modules named after `vllm/v1/core/`'s files.

An independent implementation on purpose: it shares no code with the router's core, so the property
tests compare two readings of vLLM's semantics."""
