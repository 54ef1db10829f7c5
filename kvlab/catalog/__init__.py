"""The built-in catalogue: verbatim Hugging Face configs (configs/, sources in SOURCES.md)."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kvlab.spec import ConfigError, ModelSpec, read_config, spec_from_config

CONFIG_DIR = Path(__file__).parent / "configs"
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


@cache
def _index() -> dict[str, CatalogEntry]:
    index: dict[str, CatalogEntry] = {}
    ambiguous: set[str] = set()
    for key, entry in entries().items():
        for a in _aliases(entry.hf_id) | {key}:
            if a in index and index[a] is not entry:
                ambiguous.add(a)
            index[a] = entry
    for a in ambiguous - set(entries()):
        del index[a]
    return index


def find(name: str) -> CatalogEntry | None:
    return _index().get(name.strip().lower())


def suggestions(name: str) -> list[str]:
    return difflib.get_close_matches(name.lower(), list(_index()), n=3, cutoff=0.5)


def load_config(model: str) -> tuple[dict, str]:
    """Config dict and display name for a catalogue name, a config.json or a checkpoint folder."""
    path = Path(model).expanduser()
    if path.exists():
        return read_config(path), (path.parent.name if path.is_file() else path.name)
    entry = find(model)
    if entry is None:
        hint = suggestions(model)
        extra = f"; did you mean {', '.join(hint)}?" if hint else "; `kvlab models` lists the catalogue"
        raise ConfigError(f"unknown model {model!r}: not a catalogue name or a path{extra}")
    return json.loads(entry.path.read_text()), entry.hf_id


def load_spec(model: str) -> ModelSpec:
    cfg, name = load_config(model)
    return spec_from_config(cfg, name)
