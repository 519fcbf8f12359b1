"""The decode step's parts (issue 47): the batched draw, the KV cache written in place, the thread count
picked by timing. Each changes how a step runs, never what it computes."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from twinkle.sampler import SamplingParams, kv_room, step_threads
from twinkle.sampler.decoding import choose_tokens, exponential_rows, filter_logits
from twinkle.sampler.step_threads import StepThreads


@pytest.mark.parametrize("kw", [{}, {"top_k": 50}, {"top_p": 0.9, "temperature": 0.7}])
def test_the_batched_draw_is_one_multinomial_per_row(kw):
    params = SamplingParams(**kw)
    logits_B_V = torch.randn(6, 5000, generator=torch.Generator().manual_seed(0)) * 4
    seeds = [3, 14, 15, 92, 65, 35]
    ours = [torch.Generator().manual_seed(s) for s in seeds]
    theirs = [torch.Generator().manual_seed(s) for s in seeds]
    probs_B_V = filter_logits(logits_B_V, params).softmax(dim=-1)
    for _ in range(5):  # the generators move on alike, step after step
        want = [int(torch.multinomial(probs_B_V[i], 1, generator=g)) for i, g in enumerate(theirs)]
        assert choose_tokens(logits_B_V, params, ours).tolist() == want


def test_the_vectorized_noise_is_exponential_bit_for_bit():
    like_B_V, dtype = torch.empty(3, 60_000), torch.float32
    ours = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    theirs = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    for _ in range(3):  # and the generators move on alike
        want_B_V = torch.stack([torch.empty(60_000, dtype=dtype).exponential_(generator=g) for g in theirs])
        got_B_V = exponential_rows(like_B_V, ours)
        assert got_B_V.dtype == dtype and torch.equal(got_B_V, want_B_V)
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(ours, theirs))


def test_a_nan_logit_is_a_clear_error():
    logits_B_V = torch.zeros(2, 10)
    logits_B_V[1, 3] = float("nan")
    with pytest.raises(RuntimeError, match="NaN or inf"):
        choose_tokens(logits_B_V, SamplingParams(), [torch.Generator(), torch.Generator()])


def test_the_roomy_cache_appends_in_place_and_holds_what_a_dynamic_one_holds():
    g = torch.Generator().manual_seed(0)
    cache = DynamicCache()
    cache.update(torch.randn(1, 2, 5, 4, generator=g), torch.randn(1, 2, 5, 3, generator=g), 0)
    cache.batch_repeat_interleave(3)  # a group's rows, as the sampler expands them
    reference = DynamicLayer()
    reference.update(cache.layers[0].keys.clone(), cache.layers[0].values.clone())
    kv_room.make_room(cache, 4)
    assert type(cache.layers[0]) is kv_room.RoomyLayer
    rows, buffers = 3, []
    for step in range(9):
        if step == 3:  # a row finished: the others leave for fresh tensors, then append in place again
            index = torch.tensor([0, 2])
            cache.batch_select_indices(index)
            reference.batch_select_indices(index)
            rows = 2
        new_k, new_v = torch.randn(rows, 2, 1, 4, generator=g), torch.randn(rows, 2, 1, 3, generator=g)
        got, want = cache.update(new_k, new_v, 0), reference.update(new_k, new_v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        buffers.append(got[0].data_ptr())
    # room for 4 more after the first append (steps 0-2 then 3-6 share a buffer), a new one after that
    assert len(set(buffers[:3])) == 1 and len(set(buffers[3:7])) == 1
    assert buffers[2] != buffers[3] and buffers[6] != buffers[7]


class _Clock:
    """perf_counter for step_threads: a step at 2 threads takes 10 s (a loaded machine), at 1 thread 1 s."""

    now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_steps_run_at_the_faster_thread_count_and_the_other_is_timed_again(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(step_threads, "time", clock)
    torch.set_num_threads(2)
    used = []
    with StepThreads() as threads:
        for _ in range(214):
            with threads.step():
                used.append(torch.get_num_threads())
                clock.now += 10.0 if used[-1] > 1 else 1.0
    assert torch.get_num_threads() == 2  # the caller's count is back
    # each tried, then the faster; the slower timed again once 10 / PROBE_SHARE = 100 s went to the faster
    assert [i for i, n in enumerate(used) if n == 2] == [0, 101, 202]
    times = threads.state
    with StepThreads(times) as threads:  # the next decode: its prefill, then its steps at the faster count
        threads.use_faster()
        assert torch.get_num_threads() == 1
        for _ in range(3):
            with threads.step():
                used.append(torch.get_num_threads())
                clock.now += 1.0
    assert used[-3:] == [1, 1, 1] and torch.get_num_threads() == 2
    with StepThreads(adaptive=False) as threads:
        for _ in range(3):
            with threads.step():
                used.append(torch.get_num_threads())
    assert used[-3:] == [2, 2, 2]
