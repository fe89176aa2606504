"""The `events` package's public names resolve, and importing a pure module loads no I/O library."""

from __future__ import annotations

import subprocess
import sys

import events


def test_every_exported_name_resolves() -> None:
    for name in events.__all__:
        assert getattr(events, name) is not None


def test_pure_import_does_not_load_zmq() -> None:
    code = "import sys, events.wire, events.decode, events.block_hash; print('zmq' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
