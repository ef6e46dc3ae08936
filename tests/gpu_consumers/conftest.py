"""What the GPU consumer's tests share: the tiny random Llama and its byte-level BPE tokenizer,
built once a session (tests/gpu_consumers/tiny_model.py), and its sharpened copy the slot
batching's tests run (slot_engines.py); and the engine contract's ``engine``, one of each engine
for a test module (engine_contract.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.gpu_consumers.engine_contract import ENGINES, make_engine
from tests.gpu_consumers.helpers import fake_tensorrt_llm
from tests.gpu_consumers.slot_engines import build_sharp_model
from tests.gpu_consumers.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def sharp_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sharp_model(tiny_model, tmp_path_factory.mktemp("sharp-llama"))


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=ENGINES)
async def engine(request, tiny_model):
    with fake_tensorrt_llm() if request.param == "trtllm-fake" else contextlib.nullcontext():
        engine = await make_engine(request.param, tiny_model)
        await engine.start()
        yield engine
        await engine.close()
