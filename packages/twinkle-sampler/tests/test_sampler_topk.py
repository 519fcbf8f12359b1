"""Top-k log-probs (prompt and sampled) and ignore_eos on TorchSampler, against a full peft forward."""

from __future__ import annotations

import pytest
import torch

from twinkle.sampler import SamplingParams, TorchSampler, extract_adapter

# The sampler's batches (left padding, several prompts, adapters mixed) and the reference's single
# unpadded forward reduce in other kernel blocks, so fp32 log-probs agree to a few ulps of their
# magnitude (|lp| up to ~20 has an ulp of ~2e-6), and how many depends on the CPU's kernels: relative.
RTOL, ATOL = 1e-5, 1e-5


def assert_logprobs_close(got, want) -> None:
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float32), torch.as_tensor(want), rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module")
def sampler(model_path, trainer):
    s = TorchSampler(model_path)
    s.set_adapter("tenant", extract_adapter(trainer, "tenant"))
    return s


@torch.no_grad()
def full_logp(trainer, tokens: list[int], adapter: str | None) -> torch.Tensor:
    """log-softmax of the peft trainer's logits at every position of one unpadded sequence: [T, V]."""
    ids = torch.tensor([tokens])
    if adapter is None:
        with trainer.disable_adapter():
            logits = trainer(input_ids=ids).logits
    else:
        trainer.set_adapter(adapter)
        logits = trainer(input_ids=ids).logits
    return torch.log_softmax(logits[0].float(), dim=-1)


def assert_topk_rows(rows, logp_T_V, k):
    """rows[i] are the k best (id, log-prob) of logp_T_V[i]: ids exact, values close, best first."""
    assert len(rows) == logp_T_V.shape[0]
    for row, logp_V in zip(rows, logp_T_V):
        want = logp_V.topk(k)
        assert [t for t, _ in row] == want.indices.tolist()
        assert_logprobs_close([lp for _, lp in row], want.values)


def test_prompt_top_logprobs_match_a_full_forward_in_a_padded_mixed_batch(sampler, trainer, prompts):
    # Prompts of different lengths (left padding) and different adapters share one prefill.
    rows, adapters = [prompts[1], prompts[2], prompts[3]], ["tenant", None, "tenant"]
    out = sampler.sample(rows, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=4), adapter_name=adapters)
    for prompt, adapter, response in zip(rows, adapters, out):
        tops = response.prompt_top_logprobs
        assert len(tops) == len(prompt) and tops[0] is None
        logp_T_V = full_logp(trainer, prompt, adapter)
        assert_topk_rows(tops[1:], logp_T_V[:-1], 4)
        # the prompt token's own log-prob is the same distribution read at that token
        assert_logprobs_close(
            response.prompt_logprobs[1:], logp_T_V[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        )


def test_sampled_top_logprobs_match_a_full_forward_of_the_completion(sampler, trainer, prompts):
    prompt = prompts[0]
    seq = sampler.sample(
        [prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=4, logprobs=5), adapter_name="tenant"
    )[0].sequences[0]
    logp_T_V = full_logp(trainer, prompt + seq.tokens, "tenant")[len(prompt) - 1 : -1]
    assert_topk_rows(seq.top_logprobs, logp_T_V, 5)
    assert_logprobs_close(seq.logprobs, logp_T_V.gather(1, torch.tensor(seq.tokens)[:, None])[:, 0])


def test_prompt_logprobs_flag_forms(sampler, prompts):
    plain = sampler.sample([prompts[1]], SamplingParams(max_tokens=1, prompt_logprobs=True))[0]
    assert plain.prompt_top_logprobs is None and len(plain.prompt_logprobs) == len(prompts[1])
    off = sampler.sample([prompts[1]], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert off.prompt_logprobs is None and off.prompt_top_logprobs is None
    # k beyond the vocabulary: every token, in order (no error)
    vocab = sampler.model.config.vocab_size
    wide = sampler.sample([prompts[1][:3]], SamplingParams(max_tokens=1, prompt_logprobs=vocab + 10))[0]
    assert all(len(row) == vocab for row in wide.prompt_top_logprobs[1:])
    with pytest.raises(ValueError, match="prompt_logprobs must be a bool or an int >= 0"):
        SamplingParams(prompt_logprobs=-1)


def test_ignore_eos_runs_to_max_tokens(model_path, prompts):
    s = TorchSampler(model_path)
    greedy = s.sample([prompts[0]], SamplingParams(max_tokens=6, temperature=0))[0].sequences[0].tokens
    s.eos_token_ids = [greedy[1]]  # make the second greedy token this model's end of sequence
    stopped = s.sample([prompts[0]], SamplingParams(max_tokens=6, temperature=0))[0].sequences[0]
    assert stopped.tokens == greedy[: greedy.index(greedy[1]) + 1] and stopped.stop_reason == "stop"
    through = s.sample([prompts[0]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].sequences[0]
    assert through.tokens == greedy and through.stop_reason == "length"


def test_prompt_logprob_tables_are_the_full_forward_of_each_padded_prompt(sampler, trainer, prompts):
    rows, adapters = [prompts[1], prompts[2], [prompts[0][0]]], ["tenant", None, "tenant"]
    tables = sampler.prompt_logprob_tables(rows, adapter_name=adapters)
    for prompt, adapter, table in zip(rows, adapters, tables):
        assert table.shape == (len(prompt) - 1, sampler.model.config.vocab_size) and table.dtype == torch.float32
        if len(prompt) > 1:
            assert_logprobs_close(table, full_logp(trainer, prompt, adapter)[:-1])
    # the same numbers compute_logprobs reads at the prompt's own tokens
    lps = sampler.compute_logprobs([prompts[1]], adapter_name="tenant")[0]
    assert_logprobs_close(lps[1:], tables[0].gather(1, torch.tensor(prompts[1][1:])[:, None])[:, 0])


def test_a_tiny_temperature_is_greedy_not_nan(sampler, prompts):
    greedy = sampler.sample(prompts, SamplingParams(max_tokens=5, temperature=0))
    tiny = sampler.sample(prompts, SamplingParams(max_tokens=5, temperature=1e-40, seed=1))
    assert [r.sequences[0].tokens for r in tiny] == [r.sequences[0].tokens for r in greedy]
