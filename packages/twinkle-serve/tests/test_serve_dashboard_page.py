"""The dashboard page in a real headless Chromium: a run trained through the native API shows up,
scoped to the viewer's key, with its live loss curve, plus the server's queue and throughput.

Needs Debian's chromium (`apt-get install -y --no-install-recommends chromium`) and the `playwright`
Python package (serve's test group); skipped with that reason otherwise."""

from __future__ import annotations

import os

import httpx
import pytest

from twinkle.hub import TEST_MODEL

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason=f"{CHROMIUM} is absent: install it with `apt-get install -y --no-install-recommends chromium`",
)


@pytest.fixture(scope="module")
def trained_run(server):
    from twinkle.client import TwinkleClient
    from twinkle.client.model import TransformersModel

    client = TwinkleClient(server.url, server.create_key("dash-viewer"))
    model = TransformersModel(model_id=TEST_MODEL, client=client, name="dash-run")
    model.add_adapter_to_model("default", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    model.set_optimizer("AdamW", lr=1e-2)
    rows = [{"input_ids": list(range(5, 25)), "labels": list(range(5, 25))}]
    for step in range(3):
        model.forward_backward(inputs=rows)
        model.clip_grad_and_step()
        model.log_metrics({"reward": 0.1 * step}, step=step + 1)
    model.calculate_metric().result()
    other = TwinkleClient(server.url, server.create_key("dash-other"))
    TransformersModel(model_id=TEST_MODEL, client=other, name="not-yours")
    return client, model


def test_dashboard_shows_the_run_with_its_curve(server, trained_run):
    playwright = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    client, model = trained_run
    summary = httpx.get(f"{server.url}/twinkle/v1/dashboard/summary", headers={"X-API-Key": client.api_key}).json()
    assert [r["name"] for r in summary["runs"]] == ["dash-run"]
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page()
            page.goto(f"{server.url}/dashboard#key={client.api_key}")
            run = page.locator(f'.run[data-model-id="{model.model_id}"]')
            run.wait_for(timeout=20_000)
            assert "dash-run" in run.inner_text()
            loss = run.locator('svg[data-curve="loss"]')
            assert loss.get_attribute("data-points") == "3"
            points = loss.locator("polyline").get_attribute("points").split()
            assert len(points) == 3 and len(set(points)) == 3  # three distinct points: a real curve
            assert run.locator('svg[data-curve="reward"]').get_attribute("data-points") == "3"
            assert "not-yours" not in page.inner_text("#runs")  # scoped to the viewer's key
            assert page.inner_text("#tenant") == "dash-viewer"
            assert page.inner_text("#queue").isdigit()
        finally:
            browser.close()
