"""The operator page in a real headless Chromium: a tenant key is refused (403, on the page and the
API); an operator key (`keys create --operator`) sees the queue fill while three tenants load the
server, fused passes with their rows, adapters against the memory cap, RSS and requests per route
(the 403 counted among the route's 4xx). The screenshot lands in docs/images/dashboard-operator.png.

Needs Debian's chromium and the `playwright` Python package, as test_serve_dashboard_page.py."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx
import pytest

from twinkle.hub import TEST_MODEL

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run"]  # fmt: skip
IMAGES = Path(__file__).resolve().parents[3] / "docs" / "images"
SEQ = [7 + (5 * i) % 60 for i in range(48)]
SUMMARY = "/twinkle/v1/operator/summary"

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason=f"{CHROMIUM} is absent: install it with `apt-get install -y --no-install-recommends chromium`",
)


class Load:
    """Tenants that keep several forward_backward requests queued each until stopped."""

    def __init__(self, server, sft, tenants=("op-load-a", "op-load-b", "op-load-c"), in_flight=6):
        import tinker

        self.clients = [
            tinker.ServiceClient(base_url=server.url, api_key=server.create_key(t))
            .create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=i)
            .result()
            for i, t in enumerate(tenants)
        ]
        self.sft, self.in_flight, self.stop, self.done = sft, in_flight, threading.Event(), 0
        self.threads = [threading.Thread(target=self._drive, args=(c,), daemon=True) for c in self.clients]

    def _drive(self, tc):
        while not self.stop.is_set():
            futures = [tc.forward_backward([self.sft(SEQ)] * 4, "cross_entropy") for _ in range(self.in_flight)]
            for f in futures:
                f.result()
                self.done += 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def test_operator_page_refuses_tenants_and_shows_the_load(server, sft):
    playwright = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    tenant = server.create_key("op-tenant")
    operator = server.runtime.keys.create("op-admin", operator=True)
    refused = httpx.get(server.url + SUMMARY, headers={"X-API-Key": tenant})
    assert refused.status_code == 403 and "operator key" in refused.json()["error"]
    assert httpx.get(server.url + SUMMARY).status_code == 401
    assert httpx.get(server.url + SUMMARY, headers={"X-API-Key": "tml-not-a-key"}).status_code == 401
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{server.url}/operator#key={tenant}")
            page.wait_for_function("document.getElementById('error').textContent.startsWith('403')", timeout=20_000)
            assert "operator key" in page.inner_text("#error") and page.locator("#body").is_hidden()

            page.goto(f"{server.url}/operator#key={operator}")
            page.locator("#body").wait_for(timeout=20_000)
            with Load(server, sft) as load:
                # the queue, as the page shows it, fills while the three tenants keep requests waiting
                page.wait_for_function("+document.getElementById('op-queue').textContent > 0", timeout=60_000)
                page.wait_for_function("document.getElementById('op-oldest').textContent !== 'none'", timeout=30_000)
                page.wait_for_function(
                    "parseFloat(document.getElementById('op-fused').textContent) > 0", timeout=60_000
                )
                assert int(page.inner_text("#op-tenants")) >= 3
                live = page.inner_text("#op-live")
                assert all(t in live for t in ("op-load-a", "op-load-b", "op-load-c"))
                page.wait_for_timeout(4_000)  # a few more polls: the history charts get some points
                page.mouse.move(0, 0)
                IMAGES.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(IMAGES / "dashboard-operator.png"), full_page=True)
                snap = httpx.get(server.url + SUMMARY, headers={"X-API-Key": operator}).json()
            assert load.done > 0
            assert snap["passes"]["fused_passes_total"] > 0
            assert snap["passes"]["rows_per_pass"] > 1  # (other tests' 1-row passes may share the minute)
            recent = [p for e in server.runtime.engines.values() for p in e.scheduler.recent_passes]
            assert max(rows for _, n, rows in recent if n > 1) >= 8  # two 4-datum requests in one fused pass
            assert snap["rss_bytes"] > 50 * 2**20
            assert snap["adapters"]["adapters"]["live"] >= 3
            routes = {(r["method"], r["route"]): r for r in snap["routes"]}
            assert routes[("POST", "/api/v1/forward_backward")]["2xx"] >= load.done
            assert routes[("GET", SUMMARY)]["4xx"] >= 3  # the 403 and the two 401s above
            rows = page.inner_text("#op-routes")
            assert "/api/v1/forward_backward" in rows
        finally:
            browser.close()
