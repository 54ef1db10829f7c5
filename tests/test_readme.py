"""Every command line in README.md runs as written (issue 15, item 1).

The README's indented code blocks are read at test time, so a line added or changed there is
tested as it reads. What the test changes, and nothing else, is listed in FAST and PATHS:

- FAST: per subcommand, flags that shrink the work (fewer tokens, requests, contexts) without
  changing how the line is parsed: a flag already on the line gets its value replaced in place,
  a missing one is appended. Each model is loaded once for the whole module.
- PATHS: placeholders that stand for the reader's own files, replaced by a real one.
- `kvlab serve` runs as its own process on a free port until it answers /v1/models and the page.
- `make demo` and `make test` are checked with `make -n` (what they would run): running them
  here would recreate the venv and run this very suite.
- The Python example runs with max_tokens 4.
- Where the README shows a `$ command` with what it prints, the output must contain those lines.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import kvlab.engine.llm
import kvlab.models
from kvlab.cli import main
from kvlab.models.loader import DEFAULT_DTYPE
from kvlab.models.loader import load as real_load
from tests.test_server_fixtures import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

FAST: dict[str, dict[str, str]] = {
    "generate": {"--max-tokens": "4"},
    "measure": {"--contexts": "16,32", "--new-tokens": "4", "--prompt": "8"},
    "bench": {"--num-requests": "2", "--input-len": "8:16", "--output-len": "2:4", "--hf-batch-size": "2"},
    "demo": {"--max-tokens": "8"},
    "evict": {"--context": "128", "--budgets": "64", "--chunk": "32", "--trials": "2"},
}
PATHS = {"./my-checkpoint/": "a checkpoint folder (config.json + tokenizer.json)"}


def readme_lines(prefix: str) -> list[str]:
    """The README's code lines (4-space indented, with or without a `$ ` prompt before them) that
    start with ``prefix``; the lines a `$` command prints are not commands."""
    return [m.group(1).strip() for m in re.finditer(rf"^    (?:\$ )?({re.escape(prefix)} .*)$", README, re.M)]


def shown_output(line: str) -> list[str]:
    """The lines the README shows under `$ line` (up to the next prompt or blank line)."""
    m = re.search(rf"^    \$ {re.escape(line)}\n((?:    (?!\$ ).*\n)*)", README, re.M)
    return [ln.strip() for ln in m.group(1).splitlines() if ln.strip()] if m else []


def python_example() -> str:
    m = re.search(r"^    from kvlab import .*?(?=\n\n)", README, re.M | re.S)
    assert m, "the README's Python example is gone"
    return "\n".join(line[4:] for line in m.group(0).splitlines())


def fast(argv: list[str]) -> list[str]:
    """argv with FAST's flags for its subcommand (values replaced in place or appended)."""
    out = list(argv)
    for flag, value in FAST.get(argv[0], {}).items():
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


@pytest.fixture(scope="module")
def loads_once():
    """Each model loaded once for all the README's commands (the default one takes ~5 s)."""
    cache: dict = {}

    def load(model=None, dtype=DEFAULT_DTYPE, **kw):
        key = (str(model), str(dtype), tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = real_load(model, dtype, **kw)
        return cache[key]

    mp = pytest.MonkeyPatch()
    mp.setattr(kvlab.models, "load", load)
    mp.setattr(kvlab.engine.llm, "load", load)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("my-checkpoint")
    make_tiny_model(folder)
    return {"./my-checkpoint/": str(folder)}


COMMANDS = [line for line in readme_lines("kvlab") if not line.startswith("kvlab serve")]


def test_the_readme_has_the_walkthrough():
    subcommands = {shlex.split(line, comments=True)[1] for line in readme_lines("kvlab")}
    assert {"plan", "models", "generate", "measure", "demo", "bench", "serve"} <= subcommands
    assert set(PATHS) <= {w for line in COMMANDS for w in shlex.split(line, comments=True)}


@pytest.mark.parametrize("line", COMMANDS)
def test_readme_command_runs(line, loads_once, places, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files a command writes (measure.png) land here
    argv = [places.get(w, w) for w in shlex.split(line, comments=True)[1:]]
    code = main(fast(argv))
    out, err = capsys.readouterr()
    assert code == 0, f"`{line}` exited {code}: {err}"
    assert out.strip(), f"`{line}` printed nothing"
    if "--json" in argv:
        json.loads(out.splitlines()[-1] if argv[0] == "generate" else out)
    flat = " ".join(out.split())
    for shown in shown_output(line):  # what the README says it prints, "..." standing for a path
        pattern = ".*".join(re.escape(" ".join(part.split())) for part in shown.split("..."))
        assert re.search(pattern, flat), f"`{line}` no longer prints: {shown}"
    if "--plot" in argv:
        assert (tmp_path / argv[argv.index("--plot") + 1]).stat().st_size > 10_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("line", readme_lines("kvlab serve"))
def test_readme_serve_answers(line, tmp_path):
    port = _free_port()
    argv = shlex.split(line, comments=True)[1:] + ["--port", str(port)]
    proc = subprocess.Popen([sys.executable, "-m", "kvlab.cli", *argv], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            while True:
                assert proc.poll() is None, f"`{line}` exited: {proc.stdout.read()}"
                try:
                    models = http.get("/v1/models")
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, f"`{line}` did not answer in 120 s"
                    time.sleep(0.5)
            assert models.status_code == 200 and models.json()["data"][0]["id"]
            assert "kvlab" in http.get("/").text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_readme_python_example_runs(loads_once, capsys):
    code = python_example().replace("max_tokens=32", "max_tokens=4")
    exec(compile(code, "README.md", "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all(" length " in ln or " stop " in ln for ln in lines)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("line", readme_lines("make"))
def test_readme_make_targets_exist(line):
    plan = subprocess.run(["make", "-n", *shlex.split(line, comments=True)[1:]], cwd=ROOT,
                          capture_output=True, text=True)
    assert plan.returncode == 0, plan.stderr
    assert ".venv/bin/kvlab demo" in plan.stdout if line == "make demo" else ".venv/bin/pytest" in plan.stdout
