"""Optional extras: the gateway and every command import without them; a command that needs one says so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvrouter.cli import main
from kvrouter.extras import MissingExtra, require_extra
from kvrouter.loadtest.report import Report, write_report
from kvrouter.loadtest.settings import LoadtestSettings

# What the gateway image leaves out ([loadtest]): blocked, every import of it raises ImportError.
_BLOCK = "import sys; sys.modules['matplotlib'] = None; "


def test_every_command_and_the_gateway_import_without_the_loadtest_extra() -> None:
    script = (
        _BLOCK + "import kvrouter.cli, kvrouter.gateway_worker, router.lifecycle, router.edge.asgi_app; "
        "kvrouter.cli.build_parser(); print('imported')"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "imported"


def test_loadtest_without_the_extra_names_it_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["loadtest", "--requests", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "kvrouter loadtest needs the optional [loadtest] dependencies (matplotlib not installed)" in err
    assert "pip install 'kvrouter[loadtest]'" in err
    assert not (tmp_path / "out").exists()  # refused before any stub started or file was written


def test_the_report_without_the_extra_writes_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtra, match=r"\[loadtest\]"):
        write_report(tmp_path / "out", Report(settings=LoadtestSettings(), requests_sent=0), [])
    assert not (tmp_path / "out").exists()


def test_require_extra_passes_when_installed() -> None:
    require_extra("test", "msgspec", "json", command="this test")
