"""The page in real headless Chromium (Debian's, driven by Playwright): each view is used as a
person would, and what it shows is checked against the server's JSON API."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
SHOTS = Path(__file__).resolve().parent.parent / "out" / "screenshots"  # /out/ is git-ignored
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]

# Decided before the heavy imports below (torch, the server), so an opted-out run skips at once.
if os.environ.get("CI"):  # CI always runs the browser tests, opt-out or not
    if not CHROMIUM.exists():
        raise RuntimeError("CI needs Debian's chromium at /usr/bin/chromium (`make test` installs it)")
elif os.environ.get("KVLAB_NO_BROWSER"):
    pytest.skip("browser tests skipped: Chromium opted out (make test NO_BROWSER=1); CI runs them",
                allow_module_level=True)
elif not CHROMIUM.exists():
    pytest.skip("browser tests skipped: no /usr/bin/chromium (`make test` installs it with apt-get)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")

import httpx  # noqa: E402

from kvlab.catalog import CONFIG_DIR  # noqa: E402
from tests.test_server_fixtures import MODEL_ID, LiveServer, server, tiny_bridge  # noqa: E402, F401


@pytest.fixture(scope="module")
def browser():
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):  # noqa: F811
    """A fresh page on the served app; fails the test on any script error or off-box request."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("request", lambda r: None if r.url.startswith((server.url, "data:")) else errors.append(r.url))
    pg.goto(f"{server.url}/")
    pg.wait_for_selector("body[data-ready=true]")
    yield pg
    assert pg.locator('[data-testid="error"]').is_hidden(), pg.locator('[data-testid="error"]').text_content()
    ctx.close()
    assert not errors, errors


@pytest.fixture(scope="module")
def api(server):  # noqa: F811
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _text(pg, testid: str) -> str:
    return pg.locator(f'[data-testid="{testid}"]').text_content() or ""


def _stat(pg, testid: str, key: str) -> str:
    return pg.locator(f'[data-testid="{testid}"] dd[data-key="{key}"]').text_content() or ""


def _wait_stat(pg, testid: str, key: str, want: str) -> None:
    pg.wait_for_function(
        "([t, k, w]) => document.querySelector(`[data-testid='${t}'] dd[data-key='${k}']`)?.textContent === w",
        arg=[testid, key, want], timeout=15_000)


def test_served_model_is_named(page, api):
    served = api.get("/api/options").json()["served"]
    assert served["id"] in _text(page, "served") and f"{served['num_blocks']:,} KV blocks" in _text(page, "served")


def test_first_view_opens_on_a_generation(page, api):
    """Nothing to click first: the page opens on its example prompt stepped through on the
    served model, the same run the API gives for that prompt."""
    prompt = page.input_value('#steps-form input[name="prompt"]')
    n = int(page.input_value('#steps-form input[name="max_tokens"]'))
    ref = api.post("/api/steps", json={"prompt": prompt, "max_tokens": n}).json()
    assert page.locator("#steps-out").is_visible()
    assert _text(page, "step-label").startswith(f"step 1 of {len(ref['steps'])}: generated")
    assert page.locator('[data-testid="cache-tokens"] .tok').count() == len(ref["prompt"]) + len(ref["steps"])
    assert f"{ref['totals']['cache']} tokens processed with the cache" in _text(page, "steps-summary")


def test_step_through_shows_what_each_side_computes(page, api):
    prompt, n = "the cache holds keys", 5
    ref = api.post("/api/steps", json={"prompt": prompt, "max_tokens": n}).json()
    p = len(ref["prompt"])
    page.fill('#steps-form input[name="prompt"]', prompt)
    page.fill('#steps-form input[name="max_tokens"]', str(n))
    page.click('#steps-form button[type="submit"]')
    # the first view's own run is drawn already: wait for this one's
    page.wait_for_function(f"() => document.querySelector('[data-testid=step-label]').textContent"
                           f".startsWith('step 1 of {n}:')")
    cache_row, plain_row = (page.locator(f'[data-testid="{t}"]') for t in ("cache-tokens", "nocache-tokens"))
    for k, step in enumerate(ref["steps"]):
        if k:
            page.click("#step-next")
        assert _text(page, "step-label").startswith(f"step {k + 1} of {n}")
        lo, hi = step["cache"]["computed"]
        assert cache_row.locator(".tok.computed").count() == hi - lo == (p if k == 0 else 1)
        assert cache_row.locator(".tok.cached").count() == step["cache"]["read_from_cache"]
        assert plain_row.locator(".tok.computed").count() == step["no_cache"]["computed"][1] == p + k
        assert plain_row.locator(".tok.cached").count() == 0
        assert _text(page, "cache-total") == f"{step['cache']['processed_total']:,}"
        assert _text(page, "nocache-total") == f"{step['no_cache']['processed_total']:,}"
        assert _text(page, "cache-time").endswith((" ms", " µs", " s"))
        # the chosen token's probability and the runners-up, as the API computed them
        choice = step["choice"]
        shown = _text(page, "step-choice")
        assert f"probability of {100 * choice['p']:.1f}%" in shown
        alts = page.locator('[data-testid="step-choice"] .alt')
        assert alts.count() == len(choice["top"]) == 3
        assert [alts.nth(i).locator(".p").text_content() for i in range(3)] == \
            [f"{100 * t['p']:.1f}%" for t in choice["top"]]
        assert choice["rank"] == 1 and choice["top"][0]["id"] == step["token"]["id"]  # greedy
    page.screenshot(path=str(SHOTS / "step-through.png"), full_page=True)
    assert cache_row.locator(".tok").count() == p + n
    summary = _text(page, "steps-summary")
    assert f"{ref['totals']['cache']} tokens processed with the cache" in summary
    assert f"{ref['totals']['no_cache']} without" in summary and "same tokens" in summary
    assert page.locator("#steps-chart canvas").count() == 1


def test_planner_shows_the_plan(page, api):
    page.click('nav button[data-view="planner"]')
    page.select_option('#planner-form select[name="model"]', "meta-llama/Llama-3.1-70B")
    page.fill('#planner-form input[name="context"]', "131072")
    page.fill('#planner-form input[name="users"]', "4")
    page.select_option('#planner-form select[name="gpu"]', "h100-sxm")
    ref = api.post("/api/plan", json={"model": "meta-llama/Llama-3.1-70B", "context": 131072, "users": 4,
                                      "kv_dtype": "bf16", "gpu": "h100-sxm"}).json()
    _wait_stat(page, "planner-stats", "gpus_cache_only", f"{ref['gpus_cache_only']:,}")
    assert _stat(page, "planner-stats", "kv_bytes_per_token") == "320 KiB"  # 327,680 B
    assert _stat(page, "planner-stats", "gpus_everything") == f"{ref['gpus_everything']:,}"
    assert _stat(page, "planner-stats", "max_users") == f"{ref['max_users']:,}"
    assert _stat(page, "planner-stats", "fits") == "no"
    assert "one NVIDIA H100" in _text(page, "membar-legend")  # the red line's legend
    # the same model on 8 GPUs (TP 8): the plan that fits
    page.fill('#planner-form input[name="gpus"]', "8")
    ref8 = api.post("/api/plan", json={"model": "meta-llama/Llama-3.1-70B", "context": 131072, "users": 4,
                                       "kv_dtype": "bf16", "gpu": "h100-sxm", "gpus": 8}).json()
    assert ref8["tp"] == 8 and ref8["memory"]["fits"]
    _wait_stat(page, "planner-stats", "fits", "yes")
    assert _stat(page, "planner-stats", "max_users") == f"{ref8['max_users']:,}"
    page.screenshot(path=str(SHOTS / "planner-8-gpus.png"), full_page=True)
    page.fill('#planner-form input[name="gpus"]', "1")
    _wait_stat(page, "planner-stats", "fits", "no")
    bars = page.locator('[data-testid="membar"] .seg')
    shown = {bars.nth(i).get_attribute("data-key"): int(bars.nth(i).get_attribute("data-bytes"))
             for i in range(bars.count())}
    assert shown == {s["key"]: s["bytes"] for s in ref["memory"]["segments"]}
    # a pasted config.json replaces the catalogue choice
    page.click("#planner-form details summary")
    page.fill('#planner-form textarea[name="config"]', (CONFIG_DIR / "Qwen--Qwen2.5-1.5B.json").read_text())
    _wait_stat(page, "planner-stats", "kv_bytes_per_token", "28.0 KiB")
    page.fill('#planner-form textarea[name="config"]', "{not json")
    page.wait_for_selector('[data-testid="error"]:not([hidden])')
    assert "not valid JSON" in _text(page, "error")
    page.fill('#planner-form textarea[name="config"]', "")
    _wait_stat(page, "planner-stats", "kv_bytes_per_token", "320 KiB")


def test_crossover_marks_the_crossover(page, api):
    page.click('nav button[data-view="crossover"]')
    page.select_option('#crossover-form select[name="model"]', "meta-llama/Llama-3.1-70B")
    page.fill('#crossover-form input[name="context"]', "15")  # 2^15 = 32,768 tokens
    page.fill('#crossover-form input[name="batch"]', "5")  # 2^5 = 32
    ref = api.post("/api/crossover", json={"model": "meta-llama/Llama-3.1-70B", "context": 32768, "batch": 32,
                                           "kv_dtype": "bf16", "gpu": "h100-sxm"}).json()
    want = (f"At 32,768 tokens the cache reads overtake the weight reads from a batch of "
            f"{ref['crossover_batch']:,}; at a batch of 32 from a context of {ref['crossover_context']:,} tokens.")
    page.wait_for_function("w => document.querySelector(\"[data-testid='crossover-summary']\").textContent === w",
                           arg=want, timeout=15_000)
    point = ref["point"]
    assert _stat(page, "crossover-point", "dominant") == ("cache" if point["kv_s"] >= point["weights_s"] else "weights")
    assert _stat(page, "crossover-point", "compute_bound_batch") == "never"  # 32,768-token caches outread
    for key in ("weights_s", "kv_s", "compute_s", "step_s"):
        value, unit = _stat(page, "crossover-point", key).split()
        seconds = float(value.replace(",", "")) / {"s": 1, "ms": 1e3, "µs": 1e6}[unit]
        assert seconds == pytest.approx(point[key], rel=5e-3) and "e+" not in value
    for chart in ("#chart-batch", "#chart-context"):
        assert page.locator(f"{chart} canvas").count() == 1
    # a step of seconds reads in seconds (not "1.31e+3 ms"), its charts in s too
    page.select_option('#crossover-form select[name="gpu"]', "rtx-3060")
    ref = api.post("/api/crossover", json={"model": "meta-llama/Llama-3.1-70B", "context": 32768, "batch": 32,
                                           "kv_dtype": "bf16", "gpu": "rtx-3060"}).json()
    assert ref["point"]["step_s"] > 1
    page.wait_for_function("() => document.querySelector(\"[data-testid='crossover-point'] dd[data-key='step_s']\")"
                           ".textContent.endsWith(' s')", timeout=15_000)
    value = _stat(page, "crossover-point", "step_s").removesuffix(" s")
    assert float(value.replace(",", "")) == pytest.approx(ref["point"]["step_s"], rel=5e-3) and "e+" not in value
    assert page.locator("#chart-batch .u-legend").text_content().count("(s)") == 4
    page.screenshot(path=str(SHOTS / "crossover-seconds.png"), full_page=True)
    # short contexts, a large batch: the step is the batch's FLOPs, not its reads
    page.select_option('#crossover-form select[name="gpu"]', "h100-sxm")
    page.fill('#crossover-form input[name="context"]', "8")  # 256 tokens
    page.fill('#crossover-form input[name="batch"]', "12")  # 4,096
    _wait_stat(page, "crossover-point", "dominant", "compute")
    ref = api.post("/api/crossover", json={"model": "meta-llama/Llama-3.1-70B", "context": 256, "batch": 4096,
                                           "kv_dtype": "bf16", "gpu": "h100-sxm"}).json()
    assert ref["point"]["step_s"] == ref["point"]["compute_s"]
    assert _stat(page, "crossover-point", "compute_bound_batch") == f"{ref['compute_bound_batch']:,}"


def test_live_cache_follows_the_engine(page, api):
    page.click('nav button[data-view="live"]')
    page.wait_for_selector('[data-testid="poolbar"]')
    c = api.get("/api/cache").json()
    counts = page.locator('[data-testid="poolbar"] .blk')
    assert sum(int(counts.nth(i).get_attribute("data-count")) for i in range(counts.count())) == c["num_blocks"]
    # only blocks that hold something are drawn; the free rest is a count
    held = c["num_blocks"] - c["stats"]["free_blocks"]
    assert page.locator('[data-testid="blockmap"] .grid .blk').count() == held
    assert f"{c['stats']['free_blocks']:,} free" in _text(page, "pool-summary")
    page.fill('#load-form input[name="count"]', "16")
    page.fill('#load-form input[name="max_tokens"]', "200")
    page.click('#load-form button[type="submit"]')
    # while the requests run, the map shows blocks in use, the shared prompt prefix held once by
    # several requests, and each request's block table (logical -> physical ids)
    page.wait_for_function("() => document.querySelectorAll('[data-testid=blockmap] .grid .blk.shared').length > 0 && "
                           "document.querySelectorAll('[data-testid=live-requests] tbody tr').length > 1",
                           timeout=20_000)
    page.screenshot(path=str(SHOTS / "live-cache-running.png"), full_page=True)
    rows = page.locator('[data-testid="live-requests"] tbody tr')
    table = rows.first.locator(".btable .blk.lbl")
    ids = [int(table.nth(i).text_content()) for i in range(table.count())]
    assert ids and all(0 <= b < c["num_blocks"] for b in ids)
    page.wait_for_function("() => document.querySelector('[data-testid=load-status]').textContent"
                           ".startsWith('done: 16 completed')", timeout=60_000)
    _wait_stat(page, "live-stats", "used_blocks", "0")
    page.wait_for_timeout(500)  # one more poll after the engine went idle
    c = api.get("/api/cache").json()
    s = c["stats"]
    assert s["running"] == s["waiting"] == 0 and s["used_blocks"] == 0
    assert page.locator('[data-testid="blockmap"] .grid .blk.cached').count() == s["cached_blocks"] > 0
    assert page.locator('[data-testid="blockmap"] .grid .blk.used').count() == 0
    assert _text(page, "pool-summary").startswith(f"0 in use (0 shared), {s['cached_blocks']:,} cached")
    assert _stat(page, "live-stats", "cached_blocks") == f"{s['cached_blocks']:,}"
    assert _stat(page, "live-stats", "preemptions") == f"{s['preemptions']:,}"
    assert _stat(page, "live-stats", "hit_rate").startswith(f"{100 * s['hit_rate']:.1f}%")
    assert page.locator('[data-testid="live-requests"] tbody tr').count() == 0


def test_a_large_pool_reads_at_a_glance(browser, tmp_path):
    """65,536 blocks (the default 1 GiB of a small model): one bar and the blocks in use, not a
    wall of squares, and the request table stays on the first screen."""
    live = LiveServer(tiny_bridge(tmp_path, kv_memory=65536 * 8 * 512))  # 8-token blocks of 512 B/token
    try:
        ctx = browser.new_context(viewport={"width": 1280, "height": 900})
        pg = ctx.new_page()
        pg.goto(f"{live.url}/")
        pg.wait_for_selector("body[data-ready=true]")
        pg.click('nav button[data-view="live"]')
        pg.wait_for_selector('[data-testid="poolbar"]')
        assert "65,536 blocks" in pg.locator(".blockmap h3").text_content()
        with httpx.Client(base_url=live.url, timeout=60) as http:
            http.post("/v1/completions", json={"model": MODEL_ID, "prompt": ["the cache holds keys"] * 4,
                                               "max_tokens": 8, "temperature": 0})
        pg.wait_for_function("() => document.querySelectorAll('[data-testid=blockmap] .grid .blk.cached').length > 0")
        assert pg.locator('[data-testid="blockmap"] .grid .blk').count() < 64
        box = pg.locator('[data-testid="live-requests"]').bounding_box()
        assert box is not None and box["y"] < 900  # the request table is in view
        pg.screenshot(path=str(SHOTS / "live-cache-65536-blocks.png"), full_page=True)
        assert pg.evaluate("document.documentElement.scrollHeight") < 1400
        ctx.close()
    finally:
        live.stop()


def test_the_pool_view_shows_the_prefix_tiers(browser, tmp_path):
    """A 16-block pool with a RAM and a disk tier: prompts that push each other out of the pool,
    then the first again; the tiers' rows say what /api/cache counts (bytes, blocks, hits)."""
    live = LiveServer(tiny_bridge(tmp_path, kv_memory=16 * 8 * 512, kv_offload_ram=2**20,
                                  kv_offload_dir=str(tmp_path / "kv")))
    try:
        ctx = browser.new_context(viewport={"width": 1280, "height": 900})
        pg = ctx.new_page()
        pg.goto(f"{live.url}/")
        pg.wait_for_selector("body[data-ready=true]")
        pg.click('nav button[data-view="live"]')
        pg.wait_for_selector('[data-testid="tier-ram"]')
        prompts = [f"document {i}: " + "the keys and values of every token " * 6 for i in range(4)]
        with httpx.Client(base_url=live.url, timeout=60) as http:
            for p in prompts + prompts[:1]:
                http.post("/v1/completions", json={"model": MODEL_ID, "prompt": p, "max_tokens": 1,
                                                   "temperature": 0}).raise_for_status()
            tiers = {t["name"]: t for t in http.get("/api/cache").json()["stats"]["tiers"]}
        assert tiers["ram"]["hits"] > 0
        ram = tiers["ram"]
        pg.wait_for_function("(h) => document.querySelector('[data-testid=tier-ram-summary]')"
                             ".textContent.includes(`${h} hits`)", arg=f"{ram['hits']:,}")
        said = _text(pg, "tier-ram-summary")
        assert said.startswith("RAM: ") and f"({ram['blocks']:,} blocks)" in said
        assert _text(pg, "tier-disk-summary").startswith("disk: ")
        assert "prompt tokens loaded instead of computed" in _text(pg, "tiers")
        pg.screenshot(path=str(SHOTS / "live-cache-tiers.png"), full_page=True)
        ctx.close()
    finally:
        live.stop()
