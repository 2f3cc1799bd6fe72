"""The trainer's bases (services/trainer/core.py `Encoders`): users' models loaded once per device and shared by
jobs, the least recently used dropped past `ACADEMUS_USER_BASES`, and one re-added under its name with other
weights loaded anew."""

from __future__ import annotations

from pathlib import Path

import pytest

from academus.services.trainer.core import Encoders
from academus.shared.models.user_models import add_model, remove_model
from tests.models import tiny_model_dir


@pytest.fixture
def artifacts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    artifacts = tmp_path / "artifacts"
    for name, family in (("a", "bert"), ("b", "mpnet")):
        tiny_model_dir(family, False, tmp_path / name)
        add_model(artifacts, name, tmp_path / name)
    monkeypatch.setenv("ACADEMUS_ARTIFACTS", str(artifacts))
    return artifacts


async def test_users_bases_are_kept_the_last_used_first_and_reloaded_when_their_weights_change(artifacts, tmp_path):
    encoders = Encoders(max_user_bases=1)
    a, _ = await encoders.base("cpu", "a")
    assert (await encoders.base("cpu", "a"))[0] is a                     # shared by the next job
    b, _ = await encoders.base("cpu", "b")
    assert (await encoders.base("cpu", "b"))[0] is b
    again, _ = await encoders.base("cpu", "a")                           # `a` went when `b` came: loaded anew
    assert again is not a and type(again.body).__name__ == "BertModel"
    teacher = await encoders.get("cpu")
    assert await encoders.get("cpu") is teacher and (await encoders.base("cpu", "a"))[0] is again   # kept apart

    remove_model(artifacts, "a")
    tiny_model_dir("bert", False, tmp_path / "a2", seed=9)
    add_model(artifacts, "a", tmp_path / "a2")
    assert (await encoders.base("cpu", "a"))[0] is not again            # same name, other weights
    with pytest.raises(ValueError, match="unknown adapter base 'gone'"):
        await encoders.base("cpu", "gone")
