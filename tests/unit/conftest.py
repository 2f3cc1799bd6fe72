"""Fixtures for the data and training tests: the dataset packages, fetched once when missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from academus.shared.training.data import data_dir, fetch


@pytest.fixture(scope="session")
def dataset_dir() -> Path:
    """The packages in ACADEMUS_DATA_DIR (default .academus/data), downloaded if missing."""
    return fetch(data_dir())
