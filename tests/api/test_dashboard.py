"""The dashboard (`GET /`) in a real browser: Debian's chromium driven by Playwright, never a downloaded one.

Checks what a person at the dashboard relies on: the tier numbers are the server's, a streamed
cacheblend answer shows one coloured segment per retrieved chunk with exactly the recomputed tokens
marked, a request's waterfall has its five stages, API keys work, an unreachable server is announced,
nothing is fetched from another host, and the page does not overflow a narrow window.
"""
from __future__ import annotations

import json
import os

import httpx
import pytest
from playwright.sync_api import Page, expect, sync_playwright

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY_STORE = "ragcache.apiKey"          # the sessionStorage item app.js reads the key from
ANSWER_TIMEOUT_MS = 300_000            # a CPU-only cacheblend answer, the first one included


@pytest.fixture(scope="module")
def browser():
    assert os.access(CHROMIUM, os.X_OK), f"{CHROMIUM} is missing: apt-get install -y chromium (make setup does)"
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(20_000)
    pg.js_errors = []
    pg.on("pageerror", lambda err: pg.js_errors.append(str(err)))
    pg.urls = []
    pg.on("request", lambda req: pg.urls.append(req.url))
    yield pg
    context.close()


def _use_key(page: Page, key: str | None) -> None:
    """Put the key where the dashboard keeps it, before any of its scripts run."""
    if key:
        page.add_init_script(f"sessionStorage.setItem({json.dumps(KEY_STORE)}, {json.dumps(key)})")


def _auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _assert_same_origin(page: Page, base_url: str) -> None:
    foreign = [u for u in page.urls if not u.startswith((base_url + "/", "data:", "blob:"))]
    assert not foreign, f"the dashboard fetched from elsewhere: {foreign}"


def _assert_tiers_match(page: Page, stats: dict) -> None:
    tiers = page.locator("#tiers .tier[data-tier]")
    expect(tiers).to_have_count(len(stats["tiers"]))
    for t in stats["tiers"]:
        card = page.locator(f'#tiers .tier[data-tier="{t["name"]}"]')
        for field in ("entries", "evictions", "corrupt"):
            expect(card.locator(f'[data-field="{field}"] dd')).to_have_text(str(t[field]))
        expect(card.locator('[data-field="used_bytes"]')).to_have_attribute("data-value", str(t["used_bytes"]))
        lookups = t["hits"] + t["misses"]
        if lookups:
            shown = float(card.locator('[data-field="hit_rate"]').get_attribute("data-value"))
            assert shown == pytest.approx(t["hits"] / lookups, abs=1e-9)


def test_dashboard_tiers_ask_tokens_waterfall(api_server, page, tmp_path):
    base, key = api_server.url, api_server.admin_key
    _use_key(page, key)
    page.add_init_script("""
        window.__answerMutations = 0;
        document.addEventListener("DOMContentLoaded", () => new MutationObserver(
            (records) => { window.__answerMutations += records.length; }
        ).observe(document.getElementById("answer"), {childList: true, characterData: true, subtree: true}));
    """)
    page.goto(base + "/")
    expect(page.locator("h1")).to_have_text("ragcache")

    # 1. tiers: the numbers on the page are the server's
    expect(page.locator("#tiers .tier[data-tier]").first).to_be_visible()
    stats = httpx.get(base + "/v1/cache/stats", headers=_auth(key), timeout=30).json()
    assert stats["tiers"], "the server reports no tiers"
    _assert_tiers_match(page, stats)
    expect(page.locator("#banner")).to_be_hidden()

    # 2. ask in cacheblend mode; the ratio input shows only for cacheblend
    page.fill("#ask-query", api_server.question)
    page.fill("#ask-namespace", api_server.namespace)
    page.select_option("#ask-mode", "epic")
    expect(page.locator("#ask-epic-k")).to_be_visible()
    expect(page.locator("#ask-ratio")).to_be_hidden()
    page.select_option("#ask-mode", "cacheblend")
    expect(page.locator("#ask-ratio")).to_be_visible()
    expect(page.locator("#ask-epic-k")).to_be_hidden()
    page.fill("#ask-ratio", "0.15")
    page.fill("#ask-max", "24")
    page.click("#ask-submit")
    page.wait_for_function("window.__lastResult != null", timeout=ANSWER_TIMEOUT_MS)
    result = page.evaluate("window.__lastResult")
    usage, explain = result["usage"], result["explain"]
    expect(page.locator("#ask-status")).not_to_have_class("status error")
    assert page.text_content("#answer") == result["answer"]
    if usage["completion_tokens"] > 1:  # token deltas reached the page before the final `done`
        assert page.evaluate("window.__answerMutations") >= 2

    # 3. retrieved chunks and the prompt's tokens, coloured by chunk
    n_chunks = len(result["chunks"])
    assert n_chunks > 0
    expect(page.locator("#chunks li")).to_have_count(n_chunks)
    for i, c in enumerate(result["chunks"]):
        item = page.locator(f'#chunks li[data-chunk="{i}"]')
        expect(item).to_contain_text(str(c["doc_id"]))
        expect(item.locator(".tier-badge")).to_have_text(c["tier"])
    segs = page.locator("#tokens .seg[data-chunk]")
    expect(segs).to_have_count(n_chunks)
    colours = segs.evaluate_all("els => els.map(e => getComputedStyle(e).backgroundColor)")
    assert len(set(colours)) == n_chunks, f"chunks share a colour: {colours}"
    assert page.locator("#tokens .tok").count() == len(explain["tokens"]) == usage["prompt_tokens"]
    recomputed = page.locator("#tokens .tok.recomputed").count()
    assert recomputed == usage["recomputed_tokens"] == len(explain["recomputed"])
    assert recomputed > 0
    if explain.get("deviation") and any(d is not None for d in explain["deviation"]):
        assert page.locator('#tokens .seg[data-chunk] .tok.recomputed[style*="--dev"]').count() > 0

    # 4. recent requests: the newest row is this request; its waterfall has five stages on one axis
    newest = page.locator("#recent tbody tr[data-id]").first
    expect(newest).to_have_attribute("data-id", result["request_id"], timeout=15_000)
    newest.click()
    expect(newest).to_have_class("selected")
    stages = page.locator("#waterfall .stage")
    expect(stages).to_have_count(5)
    assert stages.evaluate_all("els => els.map(e => e.dataset.stage)") == \
        ["retrieve", "load", "blend", "first token", "decode"]
    lefts = page.locator("#waterfall .stage .span").evaluate_all(
        "els => els.map(e => e.getBoundingClientRect().left)")
    assert lefts == sorted(lefts), f"stages do not follow each other on the time axis: {lefts}"

    # 5. the eval panel says what /v1/eval/latest says
    latest = httpx.get(base + "/v1/eval/latest", headers=_auth(key), timeout=30).json()
    if latest["available"]:
        expect(page.locator("#eval-table tbody tr")).to_have_count(len(latest["results"]["modes"]))
    else:
        expect(page.locator("#eval .panel-msg")).to_contain_text("ragcache eval")

    wide = tmp_path / "dashboard-1400.png"
    page.screenshot(path=str(wide), full_page=True)
    page.set_viewport_size({"width": 420, "height": 900})
    page.wait_for_timeout(300)
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the page is {overflow}px wider than a 420px window"
    narrow = tmp_path / "dashboard-420.png"
    page.screenshot(path=str(narrow), full_page=True)
    print(f"dashboard screenshots: {wide} {narrow}")

    _assert_same_origin(page, base)
    assert not page.js_errors, page.js_errors


def test_dashboard_api_keys(api_server_with_keys, page):
    server = api_server_with_keys
    base, banner = server.url, page.locator("#banner")
    auth_headers = []
    page.on("request", lambda req: auth_headers.append(req.headers.get("authorization"))
            if "/v1/cache/stats" in req.url else None)
    page.goto(base + "/")

    # no key: a clear auth message, no stale numbers
    expect(banner).to_be_visible()
    expect(banner).to_contain_text("API key")
    expect(page.locator("#tiers .tier")).to_have_count(0)

    # a wrong key is rejected, visibly
    page.fill("#api-key", "not-a-key")
    page.click("#key-save")
    expect(banner).to_contain_text("rejected")

    # a tenant key: accepted, but the stats are the admin's
    if server.tenant_keys:
        page.fill("#api-key", next(iter(server.tenant_keys)))
        page.click("#key-save")
        expect(page.locator("#tiers .panel-msg")).to_contain_text("admin key")
        expect(banner).to_be_hidden()

    # the admin key: the tiers fill in, the key sits in sessionStorage and goes out as a bearer token
    page.fill("#api-key", server.admin_key)
    page.click("#key-save")
    stats = httpx.get(base + "/v1/cache/stats", headers=_auth(server.admin_key), timeout=30).json()
    _assert_tiers_match(page, stats)
    expect(banner).to_be_hidden()
    expect(page.locator("#tiers .panel-msg")).to_be_hidden()
    assert page.evaluate(f"sessionStorage.getItem({json.dumps(KEY_STORE)})") == server.admin_key
    assert auth_headers[0] is None and auth_headers[-1] == f"Bearer {server.admin_key}"

    _assert_same_origin(page, base)
    assert not page.js_errors, page.js_errors


def test_dashboard_announces_unreachable_server(api_server, page):
    _use_key(page, api_server.admin_key)
    page.route("**/v1/**", lambda route: route.abort("connectionrefused"))
    page.goto(api_server.url + "/")
    banner = page.locator("#banner")
    expect(banner).to_be_visible()
    expect(banner).to_contain_text("unreachable")
    expect(page.locator("#conn")).to_have_text("offline")

    # the server comes back: the next poll clears the banner and fills the tiers
    page.unroute("**/v1/**")
    expect(banner).to_be_hidden(timeout=10_000)
    expect(page.locator("#tiers .tier[data-tier]").first).to_be_visible()
    assert not page.js_errors, page.js_errors
