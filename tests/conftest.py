"""Shared pytest fixtures: the lazily built model zoo (see ``model_zoo.py``)."""

from __future__ import annotations

import os
import pathlib
import sys
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_TESTS_DIR = pathlib.Path(__file__).resolve().parent
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))

import pytest

from model_zoo import ALL_BUILDERS, ZooModel


class Zoo:
    """Builds each zoo model at most once, the first time a test asks for it."""

    def __init__(self, root: pathlib.Path) -> None:
        self._root = root
        self._built: dict[str, ZooModel] = {}
        self._lock = threading.Lock()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(ALL_BUILDERS)

    def get(self, name: str) -> ZooModel:
        if name not in ALL_BUILDERS:
            raise KeyError(f"no zoo model {name!r}; known: {sorted(ALL_BUILDERS)}")
        with self._lock:
            if name not in self._built:
                directory = self._root / name
                directory.mkdir(parents=True, exist_ok=True)
                self._built[name] = ALL_BUILDERS[name](directory)
            return self._built[name]

    __getitem__ = get


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Zoo:
    """Session-wide lazy accessor: ``zoo.get("keras3_mlp") -> ZooModel``."""
    return Zoo(tmp_path_factory.mktemp("zoo"))
