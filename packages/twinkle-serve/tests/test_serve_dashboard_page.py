"""The run page in a real headless Chromium: a tenant logs in with its key and sees its runs' charts
(axes, ticks, hover values: per-token loss from loss:sum and its token counts), MFU as "n/a", a
reward chart only once a run that logs rewards is overlaid, the checkpoint table with the
`tinker://` paths, a download that is a real PEFT zip, and the samples its owner posted. Another
tenant's key sees none of it. The screenshot lands in docs/images/dashboard-run.png.

Needs Debian's chromium (`apt-get install -y --no-install-recommends chromium`) and the `playwright`
Python package (serve's test group); skipped with that reason otherwise."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import httpx
import pytest

from twinkle.hub import TEST_MODEL

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run"]  # fmt: skip
IMAGES = Path(__file__).resolve().parents[3] / "docs" / "images"
PROMPT = [5 + i for i in range(6)]  # weight 0: the prompt's targets do not count
ANSWER = [30 + (7 * i) % 40 for i in range(10)]

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason=f"{CHROMIUM} is absent: install it with `apt-get install -y --no-install-recommends chromium`",
)


def prompt_answer_datum():
    from tinker import types

    tokens = PROMPT + ANSWER
    weights = [0.0] * (len(PROMPT) - 1) + [1.0] * len(ANSWER)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


@pytest.fixture(scope="module")
def runs(server):
    """A Tinker SFT run (6 steps, two checkpoints) and a native run that logs rewards, of one tenant."""
    import tinker
    from tinker import types

    from twinkle.client import TwinkleClient
    from twinkle.client.model import TransformersModel

    key = server.create_key("dash-viewer")
    service = tinker.ServiceClient(base_url=server.url, api_key=key)
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=3).result()
    sums = []
    for step in range(6):
        sums.append(tc.forward_backward([prompt_answer_datum()], "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-2 * (0.8**step))).result()
    tc.save_state("after-6").result()
    samples = [
        {"prompt": "Translate to French: good morning", "completion": "bonjour", "step": 6},
        {"prompt": "Name a prime above 90.", "completion": "97", "reward": 1.0, "step": 6},
    ]
    r = httpx.post(f"{server.url}/twinkle/v1/dashboard/runs/{tc.model_id}/samples", headers={"X-API-Key": key},
                   json={"samples": samples})  # fmt: skip
    assert r.status_code == 200 and r.json()["kept"] == 2, r.text
    sampler = tc.save_weights_for_sampler("sampler-6", ttl_seconds=86_400).result()
    tinker.RestClient(base_url=server.url, api_key=key).publish_checkpoint_from_tinker_path(sampler.path).result()

    native = TransformersModel(model_id=TEST_MODEL, client=TwinkleClient(server.url, key), name="dash-rl")
    native.add_adapter_to_model("default", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    native.set_optimizer("AdamW", lr=1e-2)
    rows = [{"input_ids": list(range(5, 25)), "labels": list(range(5, 25))}]
    for step in range(4):
        native.forward_backward(inputs=rows)
        native.clip_grad_and_step()
        native.log_metrics({"reward": 0.2 + 0.15 * step}, step=step + 1)
    native.calculate_metric().result()
    posted = httpx.post(
        f"{server.url}/twinkle/v1/dashboard/runs/{native.model_id}/samples",
        headers={"X-API-Key": key},
        json={"samples": [{"prompt": "What is 17 + 25?", "completion": "42", "reward": 1.0, "step": 4}]},
    )
    assert posted.status_code == 200, posted.text
    return key, tc, [s / len(ANSWER) for s in sums], native


def _chromium(p):
    return p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)


def test_run_page_charts_checkpoints_download_and_overlay(server, runs, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    key, tc, per_token, native = runs
    with playwright.sync_playwright() as p:
        browser = _chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900}, accept_downloads=True)
            page.goto(f"{server.url}/dashboard#key={key}&run={tc.model_id}")
            assert "key=" not in page.url  # the key leaves the address bar once stored
            loss = page.locator('#charts svg[data-curve="loss_per_token"]')
            loss.wait_for(timeout=20_000)
            assert page.locator("tr.run").count() == 2
            assert page.inner_text("#tenant") == "dash-viewer"
            assert loss.get_attribute("data-points") == "6"
            points = loss.locator("polyline").get_attribute("points").split()
            assert len(points) == 6 and len(set(points)) == 6
            # axes with ticks: the x axis steps, the y axis round numbers spanning the per-token losses
            x_ticks = [float(t) for t in loss.locator("text.tick.x").all_text_contents()]
            y_ticks = [float(t) for t in loss.locator("text.tick.y").all_text_contents()]
            assert len(x_ticks) >= 2 and min(x_ticks) <= 1 and max(x_ticks) >= 6
            assert len(y_ticks) >= 2 and min(y_ticks) <= min(per_token) and max(y_ticks) >= max(per_token)
            # hover over the last step: the readout is loss:sum / the weighted tokens, not the sum
            box = loss.bounding_box()
            page.mouse.move(box["x"] + box["width"] - 14, box["y"] + box["height"] / 2)
            tip = page.locator('#charts .chart:has(svg[data-curve="loss_per_token"]) .tip')
            tip.wait_for(state="visible")
            assert "step 6" in tip.inner_text()
            shown = float(tip.locator("b").inner_text())
            assert shown == pytest.approx(per_token[-1], rel=1e-3)
            for name in ("lr", "grad_norm", "step_time_s", "tokens_per_s", "mfu"):
                assert page.locator(f'#charts svg[data-curve="{name}"]').count() == 1, name
            lr_points = page.locator('svg[data-curve="lr"]').get_attribute("data-points")
            assert lr_points == "6"
            assert page.locator('svg[data-curve="reward"]').count() == 0  # a supervised run: no reward panel
            # the checkpoints: both kinds, with their tinker:// paths, and a download that is a PEFT zip
            rows = page.locator("#checkpoints tr[data-path]")
            assert rows.count() == 2
            paths = sorted(rows.nth(i).get_attribute("data-path") for i in range(2))
            assert paths == sorted(
                [f"tinker://{tc.model_id}/weights/after-6", f"tinker://{tc.model_id}/sampler_weights/sampler-6"]
            )
            training = page.locator('#checkpoints tr[data-path$="/weights/after-6"]').inner_text()
            published = page.locator('#checkpoints tr[data-path$="/sampler_weights/sampler-6"]').inner_text()
            assert "training state" in training and "kept" in training and "private" in training
            assert "sampler weights" in published and "published" in published and "24.0 h" in published
            with page.expect_download() as dl:
                page.locator('#checkpoints tr[data-path$="/weights/after-6"] button.download').click()
            saved = tmp_path / "ckpt.zip"
            dl.value.save_as(saved)
            with zipfile.ZipFile(saved) as zf:
                assert sorted(zf.namelist()) == ["adapter_config.json", "adapter_model.safetensors"]
                assert zf.getinfo("adapter_model.safetensors").file_size > 1000
            # overlay the native run: its rewards get a chart, the loss chart two lines
            page.locator(f'tr.run[data-model-id="{native.model_id}"] input.cmp').check()
            page.locator('#charts svg[data-curve="reward"]').wait_for(timeout=10_000)
            assert page.locator('#charts svg[data-curve="loss_per_token"] polyline').count() == 2
            assert page.locator('#charts svg[data-curve="reward"] polyline').count() == 1
            assert page.locator("#legend .key").count() == 2
            box = page.locator('#charts svg[data-curve="loss_per_token"]').bounding_box()
            page.mouse.move(box["x"] + box["width"] * 0.62, box["y"] + box["height"] / 2)  # a readout in the picture
            page.locator('#charts .chart:has(svg[data-curve="loss_per_token"]) .tip').wait_for(state="visible")
            IMAGES.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(IMAGES / "dashboard-run.png"), full_page=True)
            # the native run's page shows its posted sample
            page.locator(f'tr.run[data-model-id="{native.model_id}"] td:nth-child(2)').click()
            page.locator("#samples .sample", has_text="What is 17 + 25?").wait_for(timeout=10_000)
            assert page.locator("#samples .sample").count() == 1  # the native run's own, not the other run's
            assert "What is 17 + 25?" in page.inner_text("#samples") and "reward 1" in page.inner_text("#samples")
            # a phone-width view has no horizontal overflow outside the scrolling tables
            phone = browser.new_page(viewport={"width": 390, "height": 844})
            phone.goto(f"{server.url}/dashboard#key={key}&run={tc.model_id}")
            phone.locator('#charts svg[data-curve="loss_per_token"]').wait_for(timeout=20_000)
            assert phone.evaluate("document.documentElement.scrollWidth") <= 390
        finally:
            browser.close()


def test_another_tenant_sees_none_of_it(server, runs):
    playwright = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    key, tc, _, native = runs
    other = server.create_key("dash-other")
    with playwright.sync_playwright() as p:
        browser = _chromium(p)
        try:
            page = browser.new_page()
            page.goto(f"{server.url}/dashboard#key={other}&run={tc.model_id}")
            page.wait_for_function("document.getElementById('tenant').textContent === 'dash-other'", timeout=20_000)
            assert page.locator("tr.run").count() == 0
            assert page.locator("#runpage").is_hidden()
            assert tc.model_id not in page.content()
        finally:
            browser.close()
    h = {"X-API-Key": other}
    for path in (f"dashboard/runs/{tc.model_id}", f"dashboard/runs/{native.model_id}/samples"):
        r = httpx.get(f"{server.url}/twinkle/v1/{path}", headers=h)
        assert r.status_code == 404 and "not found" in r.json()["error"]
    r = httpx.get(
        f"{server.url}/twinkle/v1/checkpoints/archive",
        params={"path": f"tinker://{tc.model_id}/weights/after-6"},
        headers=h,
    )
    assert r.status_code == 404
    r = httpx.post(
        f"{server.url}/twinkle/v1/dashboard/runs/{native.model_id}/samples",
        headers=h,
        json={"samples": [{"prompt": "p", "completion": "c"}]},
    )
    assert r.status_code == 404  # nobody posts onto another tenant's run page
    # the owner's download through the API is the same zip the page saved
    own = httpx.get(
        f"{server.url}/twinkle/v1/checkpoints/archive",
        params={"path": f"tinker://{tc.model_id}/weights/after-6"},
        headers={"X-API-Key": key},
    )
    assert own.status_code == 200 and "adapter_model.safetensors" in zipfile.ZipFile(io.BytesIO(own.content)).namelist()
