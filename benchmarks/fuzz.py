"""Fuzz a live server: requests generated from its own OpenAPI schema, plus hostile bodies.

Schemathesis turns /openapi.json into Hypothesis strategies for every operation (completions,
chat, models, metrics, health and the page's /api routes), both valid requests (positive) and
requests that break the schema (negative). On top of those, Hypothesis builds bodies no schema
describes: invalid UTF-8, JSON escapes of lone surrogates, control characters, stop lists of
thousands of strings, JSON nested thousands deep, chat messages with unknown roles. Targets:
no 5xx, no request past its deadline, and afterwards the server healthy with every block free.

    nice -n 10 .venv/bin/python -m benchmarks.fuzz --examples 40            # against the tiny model

The tests run the same code with fewer examples (tests/test_server_fuzz.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from hypothesis import strategies as st

from benchmarks.soak import idle_cache, leaked_blocks

DEADLINE_S = 60.0  # one request answering later than this is a hang


@dataclass
class FuzzReport:
    """Answers by operation and status, the 5xx bodies and hangs seen (first few)."""

    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    hangs: int = 0
    slowest_s: dict[str, float] = field(default_factory=dict)  # per operation

    @property
    def requests(self) -> int:
        return sum(self.statuses.values()) + self.hangs

    @property
    def server_errors(self) -> int:
        return sum(n for (_, status), n in self.statuses.items() if status >= 500)

    def record(self, name: str, send: callable) -> None:
        t0 = time.monotonic()
        try:
            status, text = send()
        except (httpx.TimeoutException, TimeoutError):
            self.hangs += 1
            self.failures.append(f"{name}: no answer within {DEADLINE_S:.0f} s")
            return
        self.slowest_s[name] = max(self.slowest_s.get(name, 0.0), time.monotonic() - t0)
        self.statuses[(name, status)] += 1
        if status >= 500 and len(self.failures) < 20:
            self.failures.append(f"{name}: {status} {text[:300]}")


def _settings(examples: int) -> settings:
    """Generation only (no shrinking: a failure is recorded, not raised), derandomised (the same
    cases every run), no example database, no time limits: the server's deadline is the one
    that counts."""
    return settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck), derandomize=True)


def pin_model(spec: dict, model: str) -> dict:
    """The schema with every request's ``model`` field pinned to the served model: any other name
    is a 404 before the engine is reached, and the point is to reach it (the 404 is one of the
    negative cases, which break the pin)."""
    for schema in spec.get("components", {}).get("schemas", {}).values():
        field = schema.get("properties", {}).get("model")
        if field is not None and field.get("type") == "string" and "model" in schema.get("required", ()):
            field["enum"] = [model]
    return spec


def fuzz_schema(url: str, model: str, examples: int, report: FuzzReport,
                headers: dict[str, str] | None = None) -> None:
    """``examples`` positive and ``examples`` negative cases for every operation in the schema."""
    spec = httpx.get(f"{url}/openapi.json", headers=headers, timeout=30).json()
    schema = schemathesis.openapi.from_dict(pin_model(spec, model))
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in schemathesis.GenerationMode:
            _fuzz_operation(url, op, mode, examples, report, headers)


def _fuzz_operation(url: str, op: schemathesis.APIOperation, mode: schemathesis.GenerationMode, examples: int,
                    report: FuzzReport, headers: dict[str, str] | None) -> None:
    name = f"{op.method.upper()} {op.path} ({mode.value})"

    @_settings(examples)
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        def send() -> tuple[int, str]:
            r = case.call(base_url=url, headers=headers, timeout=DEADLINE_S)
            return r.status_code, r.text
        report.record(name, send)
    try:
        run()
    except Unsatisfiable:  # negative cases of an operation without parameters or body: none exist
        pass


# --- bodies no schema describes ---------------------------------------------------------------

def _lone_surrogates() -> st.SearchStrategy[str]:
    """Text with ``\\udXXX`` escapes of unpaired surrogates, as JSON source (valid JSON syntax)."""
    escape = st.integers(0xD800, 0xDFFF).map(lambda c: f"\\u{c:04x}")
    plain = st.text(st.characters(codec="ascii", exclude_characters='"\\'), max_size=8)
    return st.lists(st.one_of(escape, plain), min_size=1, max_size=6).map("".join)


def _control_text() -> st.SearchStrategy[str]:
    return st.text(st.characters(categories=["Cc", "Cf", "Zl", "Zp", "Co"]), min_size=1, max_size=40)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


MODEL = "__MODEL__"  # replaced by the served model's id


def hostile_bodies() -> st.SearchStrategy[tuple[str, str, bytes]]:
    """(name, path, raw body) triples."""
    def completion(prompt_json: str, extra: str = "") -> bytes:
        return f'{{"model": "{MODEL}", "prompt": {prompt_json}, "max_tokens": 4{extra}}}'.encode()

    def chat(role_json: str, content_json: str) -> bytes:
        return (f'{{"model": "{MODEL}", "max_tokens": 4, '
                f'"messages": [{{"role": {role_json}, "content": {content_json}}}]}}').encode()

    return st.one_of(
        st.binary(min_size=1, max_size=32).map(
            lambda b: ("invalid UTF-8", "/v1/completions", completion('"x"')[:-1] + b', "user": "' + b + b'"}')),
        _lone_surrogates().map(lambda s: ("lone surrogate prompt", "/v1/completions", completion(f'"{s}"'))),
        _lone_surrogates().map(lambda s: ("lone surrogate stop", "/v1/completions",
                                          completion('"hi"', f', "stop": ["{s}"]'))),
        _lone_surrogates().map(lambda s: ("lone surrogate chat", "/v1/chat/completions", chat('"user"', f'"{s}"'))),
        _lone_surrogates().map(lambda s: ("lone surrogate model", "/v1/completions",
                                          completion('"hi"').replace(MODEL.encode(), s.encode()))),
        _lone_surrogates().map(lambda s: ("lone surrogate steps", "/api/steps",
                                          f'{{"prompt": "{s}", "max_tokens": 2}}'.encode())),
        _control_text().map(lambda s: ("control characters", "/v1/completions",
                                       completion(json.dumps(s), f', "stop": {json.dumps([s[:3]])}'))),
        st.integers(5, 50_000).map(lambda n: ("huge stop list", "/v1/completions",
                                              completion('"hi"', f', "stop": {json.dumps([f"s{i}" for i in range(n)])}'))),
        st.integers(100, 200_000).map(lambda d: ("deeply nested prompt", "/v1/completions", completion(_nested(d)))),
        st.integers(100, 200_000).map(lambda d: ("deeply nested config", "/api/plan",
                                                 f'{{"config": {{"a": {_nested(d)}}}}}'.encode())),
        st.integers(100, 200_000).map(lambda d: ("deeply nested body", "/v1/chat/completions", _nested(d).encode())),
        st.text(max_size=20).filter(lambda r: r not in {"system", "developer", "user", "assistant", "tool"}).map(
            lambda r: ("unknown chat role", "/v1/chat/completions", chat(json.dumps(r), '"hi"'))),
    )


def fuzz_hostile(url: str, model: str, examples: int, report: FuzzReport,
                 headers: dict[str, str] | None = None) -> None:
    """``examples`` bodies from ``hostile_bodies``."""
    with httpx.Client(base_url=url, timeout=DEADLINE_S, headers=headers) as http:
        @_settings(examples)
        @given(item=hostile_bodies())
        def run(item: tuple[str, str, bytes]) -> None:
            name, path, body = item
            body = body.replace(MODEL.encode(), model.encode())

            def send() -> tuple[int, str]:
                r = http.post(path, content=body, headers={"Content-Type": "application/json"})
                return r.status_code, r.text
            report.record(f"POST {path} ({name})", send)
        run()


def check_after(url: str, headers: dict[str, str] | None = None) -> dict:
    """The server's state once the fuzzing is over: healthy, idle, every block free or cached."""
    cache = idle_cache(url, headers)
    health = httpx.get(f"{url}/health", timeout=30).status_code
    return {"health": health, "requests_left": len(cache["requests"]), "used_blocks": cache["stats"]["used_blocks"],
            "leaked_blocks": leaked_blocks(cache)}


def main() -> int:
    from tempfile import TemporaryDirectory

    from tests.test_server_fixtures import MODEL_ID, LiveServer, tiny_bridge

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=40,
                   help="cases per operation and mode, and 10x that many hostile bodies (default 40)")
    args = p.parse_args()
    with TemporaryDirectory() as tmp:
        from pathlib import Path

        live = LiveServer(tiny_bridge(Path(tmp)))
        try:
            report = FuzzReport()
            t0 = time.monotonic()
            fuzz_schema(live.url, MODEL_ID, args.examples, report)
            fuzz_hostile(live.url, MODEL_ID, 10 * args.examples, report)
            elapsed = time.monotonic() - t0
            after = check_after(live.url)
        finally:
            live.stop()
    by_op: Counter[str] = Counter()
    for (name, _), n in report.statuses.items():
        by_op[name] += n
    result = {"requests": report.requests, "seconds": round(elapsed, 1), "server_errors": report.server_errors,
              "hangs": report.hangs, **after,
              "slowest_s": {k: round(v, 2) for k, v in sorted(report.slowest_s.items(), key=lambda kv: -kv[1])[:5]},
              "statuses": dict(Counter(s for (_, s) in report.statuses.elements())),
              "by_operation": dict(by_op), "failures": report.failures}
    print(json.dumps(result, indent=1))
    ok = (report.server_errors == 0 and report.hangs == 0 and after["health"] == 200
          and after["used_blocks"] == 0 and after["leaked_blocks"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
