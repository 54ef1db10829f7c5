"""The page's eviction view in headless Chromium: each policy's kept tokens drawn as the API
computed them, with the bytes saved."""

from __future__ import annotations

from tests.test_web_page import SHOTS, _text, api, browser, page  # noqa: F401 (fixtures)
from tests.test_server_fixtures import server  # noqa: F401


def test_eviction_view_draws_each_policys_choice(page, api):  # noqa: F811
    prompt = "the cache holds keys and values " * 6
    ref = api.post("/api/evict", json={"prompt": prompt, "budget": 12}).json()
    assert [p["policy"] for p in ref["policies"]] == ["full", "window", "streaming", "h2o", "snapkv", "adakv"]
    page.click('nav button[data-view="evict"]')
    page.fill('#evict-form textarea[name="prompt"]', prompt)
    page.fill('#evict-form input[name="budget"]', "12")
    page.click('#evict-form button[type="submit"]')
    page.wait_for_selector("#evict-out:not([hidden])")
    n = len(ref["tokens"])
    for p in ref["policies"]:
        row = page.locator(f'.policy[data-policy="{p["policy"]}"]')
        assert row.locator(".tok").count() == n
        for role in ("sink", "heavy", "recent", "kept", "evicted"):
            assert row.locator(f".tok.{role}").count() == p["roles"].count(role), (p["policy"], role)
        assert f"{p['kept']} of {n} tokens kept" in (row.locator("h3").text_content() or "")
        assert (row.locator(".tok.scored").count() == n) == (p["mass"] is not None)
    streaming = ref["policies"][2]
    assert streaming["roles"][:4] == ["sink"] * 4 and streaming["kept"] == 12
    assert ref["policies"][0]["kept"] == n and ref["policies"][1]["roles"][0] == "evicted"
    # the frontier measured on real models of the served (llama) family, one row each
    measured = ref["measured"]
    assert measured and {r["model_type"] for r in measured} == {"llama"}
    rows = page.locator('[data-testid="evict-measured"] tbody tr')
    assert rows.count() == len(measured)
    first = rows.nth(0).locator("td").all_text_contents()
    assert first[4] == measured[0]["policy"] and first[1] == measured[0]["task"]
    page.screenshot(path=str(SHOTS / "eviction.png"), full_page=True)


def test_eviction_view_refuses_a_budget_below_the_sinks(api):  # noqa: F811
    res = api.post("/api/evict", json={"prompt": "hello there", "budget": 4})
    assert res.status_code == 400 and "at least 5" in res.json()["error"]["message"]
