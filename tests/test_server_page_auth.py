"""The page on a server started with --api-key, in headless Chromium: it asks for the key, keeps
it for the tab (sessionStorage) and sends it as a bearer token, after which every view that runs
the model or reads the cache works as without a key."""

from __future__ import annotations

import os
from pathlib import Path

from tests.test_server_auth import KEY, keyed  # noqa: F401
from tests.test_web_page import browser  # noqa: F401  (skips with the browser tests)


def test_the_page_works_with_the_key(browser, keyed):  # noqa: F811
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = ctx.new_page()
    script_errors: list[str] = []
    pg.on("pageerror", lambda e: script_errors.append(str(e)))
    pg.goto(f"{keyed.url}/")
    pg.wait_for_selector("body[data-ready=true]")
    # without the key: the page says so and offers the key field
    assert pg.locator('[data-testid="auth"]').is_visible()
    assert "API key" in pg.locator('[data-testid="error"]').text_content()
    shot = os.environ.get("KVLAB_SCREENSHOTS")  # a folder, to look at the key prompt
    if shot:
        pg.screenshot(path=str(Path(shot) / "page-api-key.png"))
    pg.fill('#auth input[name="key"]', KEY)
    pg.click('#auth button[type="submit"]')
    pg.wait_for_function("() => document.querySelector('[data-testid=served]').textContent.startsWith('serving')")
    assert pg.locator('[data-testid="auth"]').is_hidden() and pg.locator('[data-testid="error"]').is_hidden()
    assert pg.evaluate("sessionStorage.getItem('kvlab-api-key')") == KEY

    pg.click('#steps-form button[type="submit"]')  # the step-through runs the model: /api/steps
    pg.wait_for_selector("#steps-out:not([hidden])")
    pg.click('nav button[data-view="live"]')  # the live pool (/api/cache) and a load (/v1/completions)
    pg.fill('#load-form input[name="count"]', "4")
    pg.click('#load-form button[type="submit"]')
    pg.wait_for_function("() => document.querySelector('[data-testid=load-status]').textContent"
                         ".startsWith('done: 4 completed')", timeout=60_000)
    assert pg.locator('[data-testid="error"]').is_hidden()

    pg.reload()  # the key lasts as long as the tab
    pg.wait_for_function("() => document.querySelector('[data-testid=served]').textContent.startsWith('serving')")
    assert pg.locator('[data-testid="auth"]').is_hidden()
    ctx.close()
    assert not script_errors, script_errors
