"""Every command line in README.md and in docs/*.md runs as written (issue 15, item 1; issue 35).

The pages' indented code blocks are read at test time, so a line added or changed in any of
them is tested as it reads. A line shown in several pages runs once (its shown outputs are
checked from every page that shows one). What the test changes, and nothing else, is listed in
FAST and PATHS:

- FAST: per subcommand, flags that shrink the work (fewer tokens, requests, contexts) without
  changing how the line is parsed: a flag already on the line gets its value replaced in place,
  a missing one is appended. Every subcommand shown must be in FAST or in NO_SHRINK (cheap as
  written), so a new command line cannot slip in at full size. Each model is loaded once for the
  whole module.
- PATHS: placeholders that stand for the reader's own files, replaced by a real one.
- `kvlab serve` runs as its own process on a free port until it answers /v1/models and the page.
- `make ...` lines are checked with `make -n` (what they would run): running `make demo` or
  `make test` here would recreate the venv and run this very suite. `.ci/run` must call the
  README's test command, `make test`.
- The Python examples (`from kvlab import ...`) run with max_tokens 4.
- Where a page shows a `$ command` with what it prints, the output must contain those lines.

Benchmark commands are deliberately not run: they take minutes at full size and many need peers
(vLLM, llama.cpp, OpenVINO) installed outside kvlab's venv. The rule is by the command, not by
the page, so it holds wherever such a line is shown:

- a line that starts with `kvlab ` runs (above) in every page, docs/benchmarks.md included;
- a line that starts with a path to kvlab (`.venv/bin/kvlab bench ...`: the record of a
  full-size run as it was taken) is parsed by kvlab's own argument parser, so its subcommand and
  flags still exist, and not run (a trailing "(and --flag)" note is dropped first);
- every script a page names under `benchmarks/` (`python benchmarks/NAME.py`, `-m
  benchmarks.NAME`, in a code line or in prose) must exist; none is run;
- other code lines (torchrun across two machines, a peer's own commands, log lines) are shown
  for reading only.
"""

from __future__ import annotations

import json
import os
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
from kvlab.cli import build_parser, main
from kvlab.models.loader import DEFAULT_DTYPE
from kvlab.models.loader import load as real_load
from tests.test_server_fixtures import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
PAGES = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
README = PAGES["README.md"]

FAST: dict[str, dict[str, str]] = {
    "generate": {"--max-tokens": "4"},
    "measure": {"--contexts": "16,32", "--new-tokens": "4", "--prompt": "8"},
    "bench": {"--num-requests": "2", "--input-len": "8:16", "--output-len": "2:4", "--hf-batch-size": "2"},
    "demo": {"--max-tokens": "8"},
    "evict": {"--context": "320", "--budgets": "64", "--chunk": "32", "--trials": "2"},  # room for a question
}
NO_SHRINK = {"plan", "models"}  # no model runs: as written they take a second
PATHS = {"./my-checkpoint/": "a checkpoint folder (config.json + tokenizer.json)"}
MAKE_RUNS = {"demo": ".venv/bin/kvlab demo", "test": ".venv/bin/pytest",
             "models": ".venv/bin/kvlab models --install"}  # what each shown target must run
def page_lines(text: str, prefix: str) -> list[str]:
    """A page's code lines (4-space indented, with or without a `$ ` prompt before them) that
    start with ``prefix``; the lines a `$` command prints are not commands."""
    return [m.group(1).strip() for m in re.finditer(rf"^    (?:\$ )?({re.escape(prefix)} .*)$", text, re.M)]


def shown_output(text: str, line: str) -> list[str]:
    """The lines a page shows under `$ line` (up to the next prompt or blank line)."""
    m = re.search(rf"^    \$ {re.escape(line)}\n((?:    (?!\$ ).*\n)*)", text, re.M)
    return [ln.strip() for ln in m.group(1).splitlines() if ln.strip()] if m else []


def argv_of(line: str) -> tuple[str, ...]:
    return tuple(shlex.split(line, comments=True)[1:])


def shown_once(prefix: str) -> dict[tuple[str, ...], list[tuple[str, str]]]:
    """Each distinct command line over all pages (by its words, comments aside), with the pages
    and the exact text it is shown as there."""
    lines: dict[tuple[str, ...], list[tuple[str, str]]] = {}
    for page, text in PAGES.items():
        for line in page_lines(text, prefix):
            lines.setdefault(argv_of(line), []).append((page, line))
    return lines


def python_examples() -> dict[str, str]:
    """Each distinct Python example (a code block that starts `from kvlab import`), by its code."""
    found: dict[str, str] = {}
    for page, text in PAGES.items():
        for m in re.finditer(r"^    from kvlab import .*?(?=\n\n|\n?\Z)", text, re.M | re.S):
            found.setdefault("\n".join(line[4:] for line in m.group(0).splitlines()), page)
    return found


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
    """Each model loaded once for all the pages' commands (the default one takes ~5 s)."""
    cache: dict = {}

    def load(model=None, dtype=DEFAULT_DTYPE, **kw):
        key = (str(model), str(dtype), tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = real_load(model, dtype, **kw)
        return cache[key]

    mp = pytest.MonkeyPatch()
    mp.setattr(kvlab.models, "load", load)
    mp.setattr(kvlab.models.loader, "load", load)  # load_options, which every command calls
    yield
    mp.undo()


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("my-checkpoint")
    make_tiny_model(folder)
    return {"./my-checkpoint/": str(folder)}


KVLAB = shown_once("kvlab")
COMMANDS = {argv: shown for argv, shown in KVLAB.items() if argv[0] != "serve"}
SERVES = {argv: shown for argv, shown in KVLAB.items() if argv[0] == "serve"}


def _ids(lines: dict) -> list[str]:
    return [" ".join(argv) for argv in lines]


def test_the_readme_is_a_guide():
    """The README stays a guide (issue 35): short, the two commands, the quick start's five things."""
    assert len(README.splitlines()) <= 200
    assert {"make demo", "make test"} <= set(page_lines(README, "make"))
    subcommands = {argv_of(line)[0] for line in page_lines(README, "kvlab")}
    assert {"plan", "generate", "serve", "measure", "evict"} <= subcommands
    assert re.search(r"^    from kvlab import ", README, re.M), "the README's Python example is gone"


def test_ci_runs_the_readme_test_command():
    """`.ci/run` calls exactly the test command the README gives a fresh machine."""
    assert "make test" in page_lines(README, "make")
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(), re.M)


def test_cli_md_documents_every_command_and_option():
    """docs/cli.md has a section with an example line for every subcommand, and names every
    option kvlab's parser takes (a flag added to the CLI must be documented there)."""
    cli = PAGES["docs/cli.md"]
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, sub in subparsers.choices.items():
        assert f"## `kvlab {name}`" in cli, f"docs/cli.md has no section for kvlab {name}"
        assert any(argv_of(line)[0] == name for line in page_lines(cli, "kvlab")), f"no example of kvlab {name}"
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert re.search(rf"`{re.escape(flag)}[` ]", cli), f"docs/cli.md does not name kvlab {name} {flag}"


def test_every_command_is_shrunk_or_cheap():
    """FAST covers every subcommand the pages show that runs a model; the placeholders are used."""
    assert {argv[0] for argv in COMMANDS} <= set(FAST) | NO_SHRINK
    assert set(PATHS) <= {w for argv in COMMANDS for w in argv}


@pytest.mark.parametrize("key", list(COMMANDS), ids=_ids(COMMANDS))
def test_shown_command_runs(key, loads_once, places, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files a command writes (measure.png) land here
    shown_as = COMMANDS[key]
    first = shown_as[0][1]
    argv = [places.get(w, w) for w in key]
    code = main(fast(argv))
    out, err = capsys.readouterr()
    where = ", ".join(sorted({page for page, _ in shown_as}))
    assert code == 0, f"`{first}` ({where}) exited {code}: {err}"
    assert out.strip(), f"`{first}` ({where}) printed nothing"
    if "--json" in argv:
        json.loads(out.splitlines()[-1] if argv[0] == "generate" else out)
    flat = " ".join(out.split())
    for page, line in shown_as:
        for shown in shown_output(PAGES[page], line):  # what the page says it prints, "..." for a path
            pattern = ".*".join(re.escape(" ".join(part.split())) for part in shown.split("..."))
            assert re.search(pattern, flat), f"`{line}` no longer prints ({page}): {shown}"
    if "--plot" in argv:
        assert (tmp_path / argv[argv.index("--plot") + 1]).stat().st_size > 10_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv", list(SERVES), ids=_ids(SERVES))
def test_shown_serve_answers(argv, tmp_path):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvlab.cli", *argv, "--port", str(port)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = SERVES[argv][0][1]
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


@pytest.mark.parametrize("code", list(python_examples()), ids=list(python_examples().values()))
def test_shown_python_example_runs(code, loads_once, capsys):
    exec(compile(re.sub(r"max_tokens=\d+", "max_tokens=4", code), python_examples()[code], "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines, "the example printed nothing"
    if "finish_reason" in code:
        assert all(" length " in ln or " stop " in ln for ln in lines)


def _make_env() -> dict[str, str]:
    """Run from inside `make test` (as CI does), a child make would inherit the parent's level
    and flags: it gets them cleared."""
    return {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}


MAKES = shown_once("make")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("argv", list(MAKES), ids=_ids(MAKES))
def test_shown_make_targets_exist(argv):
    targets = [w for w in argv if "=" not in w]
    assert len(targets) == 1 and targets[0] in MAKE_RUNS, f"say in MAKE_RUNS what `make {' '.join(argv)}` runs"
    plan = subprocess.run(["make", "-n", "--no-print-directory", *argv], cwd=ROOT, env=_make_env(),
                          capture_output=True, text=True)
    assert plan.returncode == 0, plan.stderr
    assert MAKE_RUNS[targets[0]] in plan.stdout


def _recorded_runs() -> list[tuple[str, str]]:
    """The `.venv/bin/kvlab ...` lines: records of full-size runs, with any trailing note dropped."""
    runs = []
    for page, text in PAGES.items():
        for line in page_lines(text, ".venv/bin/kvlab"):
            runs.append((page, re.sub(r"\s{2,}\(.*\)\s*$", "", line)))
    return runs


@pytest.mark.parametrize("page,line", _recorded_runs(), ids=[line for _, line in _recorded_runs()])
def test_recorded_benchmark_runs_still_parse(page, line):
    """Not run (minutes at full size): kvlab's parser still takes the subcommand and every flag."""
    build_parser().parse_args(list(argv_of(line)))


def test_named_benchmark_scripts_exist():
    """Every script a page names under benchmarks/ is there (none is run: see the docstring)."""
    named = set()
    for page, text in PAGES.items():
        named |= {(page, m) for m in re.findall(r"\bbenchmarks/[\w/.-]+\.(?:py|sh)\b", text)}
        named |= {(page, f"benchmarks/{m}.py") for m in re.findall(r"-m benchmarks\.(\w+)", text)}
    assert named
    missing = sorted(f"{page}: {path}" for page, path in named if not (ROOT / path).is_file())
    assert not missing, missing


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#+ (.*)$", text, re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_links_between_pages_resolve():
    """Every relative link of the README and docs/ names a file that exists, and a heading of it."""
    broken = []
    for page, text in PAGES.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https://...
            path, _, anchor = target.partition("#")
            file = (ROOT / page).parent / path if path else ROOT / page
            name = file.resolve().relative_to(ROOT).as_posix()
            if not file.exists():
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{page}: {target} (no such heading)")
    assert not broken, broken
