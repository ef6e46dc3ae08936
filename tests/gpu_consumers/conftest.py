"""What the GPU consumer's tests share: the tiny random Llama and its byte-level BPE tokenizer,
built once a session (tests/gpu_consumers/tiny_model.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.gpu_consumers.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)
