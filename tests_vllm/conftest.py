"""Fixtures of the vLLM suite: local model directories, ports, P and D engines (closed after)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import DEEPSEEK, LLAMA, Engine, EngineSpec, write_model_dir


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model_dir(tmp_path_factory.mktemp("llama"), LLAMA)


@pytest.fixture(scope="session")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model_dir(tmp_path_factory.mktemp("deepseek"), DEEPSEEK)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    """``make(model_dir, role, **EngineSpec fields)``; every engine is closed at teardown."""
    made: list[Engine] = []

    def make(model_dir: str, role: str, **kwargs: Any) -> Engine:
        name = kwargs.pop("engine_id", "prefill" if role == "kv_producer" else "decode")
        engine_id = f"{name}-{free_port()}"
        spec = EngineSpec(model_dir=model_dir, role=role, engine_id=engine_id, port=free_port(), **kwargs)
        engine = Engine(spec)
        made.append(engine)
        return engine

    yield make
    for engine in reversed(made):
        engine.close()


@pytest.fixture
def model_dirs(llama_dir: str, deepseek_dir: str) -> dict[str, Path]:
    return {"llama": Path(llama_dir), "deepseek": Path(deepseek_dir)}
