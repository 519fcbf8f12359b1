"""Work over a tenant's input-token rate queues instead of failing (issue 27): it is accepted at once,
held in its own queue until the rate allows it, run in order, and every poll of its future says where
it waits — Tinker's `queue_state` / `queue_state_reason`, which the unmodified SDK hands its queue
observer, and the native API's `queue_state` / `queue_reason`. Past `max_queue_wait_s` it is a 429."""

from __future__ import annotations

import time

import pytest

from twinkle.serve.config import Limits
from twinkle.serve.limits import LimitExceeded, TenantLimits

RATE = 20.0  # input tokens/s


def test_the_rate_queues_work_first_come_first_served_and_refuses_past_the_longest_wait():
    limits = TenantLimits(Limits(), {"frank": Limits(input_tokens_per_s=RATE, max_queue_wait_s=2.5)})
    t0 = time.monotonic()
    assert limits.input_tokens("frank", 20) is None  # a full bucket: runs in turn
    holds = [limits.input_tokens("frank", 20) for _ in range(2)]  # each waits a second more than the last
    assert [round(h.until - t0) for h in holds] == [1, 2]
    assert holds[0].limit == "tenant 'frank''s limit of 20 input tokens/s"
    with pytest.raises(LimitExceeded) as refused:  # its turn would come 3 s from now: past 2.5 s
        limits.input_tokens("frank", 20)
    assert "would hold this request 3 s, more than max_queue_wait_s (2.5 s)" in str(refused.value)
    assert refused.value.retry_after == 1  # the queue's head moves up by then
    assert limits.input_tokens("other", 10**6) is None  # another tenant is not held by frank's rate


@pytest.fixture(scope="module")
def limited(start, tmp_path_factory):
    srv = start(
        tmp_path_factory.mktemp("queued"),
        long_poll_s=0.3,  # a poll answers try_again quickly, so the test sees where work waits
        tenant_limits={"frank": {"input_tokens_per_s": RATE}},
    )
    yield srv, srv.create_key("frank")
    srv.stop()


def test_the_sdk_gets_queued_work_done_and_is_told_where_it_waits(limited, sft):
    import tinker

    srv, key = limited
    training = (
        tinker.ServiceClient(base_url=srv.url, api_key=key)
        .create_lora_training_client(base_model=srv.runtime.config.models[0].name, rank=2)
        .result()
    )
    seen: list[tuple[str, str | None]] = []
    observer = training._queue_state_logger  # the SDK's own observer of try_again answers, wrapped
    forward = observer.on_queue_state_change
    observer.on_queue_state_change = lambda state, reason: (seen.append((state.value, reason)), forward(state, reason))
    datum = sft(list(range(10, 31)))  # 20 input tokens: a second's worth of the rate
    t0 = time.monotonic()
    futures = [training.forward_backward([datum], "cross_entropy") for _ in range(4)]
    losses = [f.result().metrics["loss:sum"] for f in futures]
    elapsed = time.monotonic() - t0
    assert len(set(losses)) == 1  # no optim_step between them: the same loss four times, none refused
    assert elapsed >= 2.5  # the 2nd, 3rd and 4th started 1, 2 and 3 s after the first (a little early is rounding)
    paused = [reason for state, reason in seen if state == "paused_rate_limit"]
    assert paused, seen
    assert any(f"held by tenant 'frank''s limit of {RATE:g} input tokens/s: starts in" in r for r in paused), paused
    assert seen[-1][0] == "active"  # the SDK says so once its future is done


def test_a_native_future_says_it_is_held_and_by_what(limited):
    from twinkle.client import TwinkleClient
    from twinkle.client.model import TransformersModel

    srv, key = limited
    model = TransformersModel(model_id=srv.runtime.config.models[0].name, client=TwinkleClient(srv.url, key))
    model.add_adapter_to_model("a", {"r": 2, "target_modules": ["q_proj"]})
    row = {"input_ids": list(range(10, 50)), "labels": list(range(10, 50))}  # 40 tokens: two seconds' worth
    first, second = model.forward_only([row], adapter_name="a"), model.forward_only([row], adapter_name="a")
    assert not second.done()
    assert second.queue_state == "paused_rate_limit", (second.queue_state, second.queue_reason)
    assert second.queue_reason is not None and "input tokens/s: starts in" in second.queue_reason
    assert first.result()["loss"] == pytest.approx(second.result()["loss"], rel=1e-6)
