"""stable_reinforce's server side: record sampled sequences, and resolve training datums' provenance.

Sampling with `record_stability_info` stores, per sampled sequence (`SampledSequence.sequence_id`), its
request's prompt, its tokens, the sampler's log-prob of each token and the policy version that sampled
it (core/store/stability_tables.py). A `forward_backward(loss_fn="stable_reinforce")` datum names, by
provenance spans (tinker `Datum.with_provenance`), which recorded positions each of its positions is:
`model_input_spans` tile the input tokens, `loss_fn_input_spans` tile `target_tokens`. Resolving checks
every span (the tenant's and this session's, not expired, inside the sequence, the same tokens) and fills
the loss's inputs from the records: `logprobs` (the sampler's, not the client's) and `sampled_mask` (1
on sampled targets, 0 on prompt targets). Any bad span is a 400 naming it.

Choices where Tinker's documentation is silent (docs/tinker.md "StableReinforce"):
- a prompt span in `loss_fn_input_spans` is not compared token by token: RL datums put placeholder
  targets (0) on prompt positions (cookbook rl_loop.py); its positions get no policy gradient;
- records are session-scoped like Tinker's: a run trains only on sequences its own session sampled;
- "trainable for one day after sampling; each training request that uses a sequence restarts that
  day": `stability_ttl_s` (86400) since last use; expired records are dropped at the next sample.
"""

from __future__ import annotations

import time

import numpy as np

from twinkle.serve.core.records import Run, SamplingSession
from twinkle.serve.core.store.stability_tables import StabilityRecord
from twinkle.serve.errors import BadRequest
from twinkle.serve.tinker.codec import Span
from twinkle.serve.tinker.datums import Datum


class Provenance:
    def __init__(self, svc):
        self.svc, self.store = svc, svc.rt.store
        self.ttl_s = float(svc.rt.config.stability_ttl_s)
        self.max_tokens = int(svc.rt.config.stability_max_tokens)

    # ---- policy versions ------------------------------------------------------------------------
    def version_of(self, model_id: str, before: float | None = None) -> int:
        """A run's policy version: its optimizer steps so far (or before time `before`)."""
        return self.store.curves.count(model_id, "lr", before)

    def snapshot(self, sampler_id: str, model_id: str) -> None:
        """A sampler on the run's current weights (save_weights_and_get_sampling_client) serves this version."""
        self.store.stability.set_policy(sampler_id, model_id, self.version_of(model_id))

    def policy(self, tenant: str, sampler: SamplingSession) -> tuple[str | None, int]:
        known = self.store.stability.policy(sampler.sampler_id)
        if known is not None:
            return known
        if sampler.model_path:  # a saved checkpoint: the run's steps when it was saved
            ckpt = self.svc.checkpoints.readable(tenant, sampler.model_path)
            return ckpt.model_id, self.version_of(ckpt.model_id, before=ckpt.created_at)
        return None, 0  # the base model

    # ---- recording ------------------------------------------------------------------------------
    def record(self, tenant: str, sampler: SamplingSession, policy, sequence_ids, prompt, sequences) -> None:
        """Called on the worker when a recorded sample finishes (before its result is visible)."""
        now = time.time()
        self.store.stability.prune(tenant, now - self.ttl_s, max(0, self.max_tokens - self._size(prompt, sequences)))
        model_id, version = policy
        for sid, seq in zip(sequence_ids, sequences):
            self.store.stability.put(
                StabilityRecord(
                    sid,
                    tenant,
                    sampler.session_id,
                    sampler.sampler_id,
                    model_id,
                    version,
                    np.asarray(prompt, dtype=np.int32),
                    np.asarray(seq.tokens, dtype=np.int32),
                    np.asarray(seq.logprobs, dtype=np.float32),
                    now,
                    now,
                )
            )

    @staticmethod
    def _size(prompt, sequences) -> int:
        return sum(len(prompt) + len(s.tokens) for s in sequences)

    # ---- resolving ------------------------------------------------------------------------------
    def resolve(self, tenant: str, run: Run, data: list[Datum], spans: list) -> tuple[list[Datum], dict]:
        """-> (datums whose `logprobs` / `sampled_mask` come from the records, metrics); 400 on a bad span."""
        ids = [s.sequence_id for pair in spans if pair for field in pair for s in field]
        records = self.store.stability.owned(ids, tenant)
        now, out, lags = time.time(), [], []
        for i, (d, pair) in enumerate(zip(data, spans)):
            if pair is None:
                raise BadRequest(
                    f"datum {i}: loss_fn 'stable_reinforce' needs provenance spans on every datum "
                    "(Datum.with_provenance, naming sequences sampled with record_stability_info)"
                )
            if "target_tokens" not in d.inputs:
                raise BadRequest(f"datum {i}: loss 'stable_reinforce' needs loss_fn_inputs['target_tokens']")
            n = len(d.tokens)
            targets = d.inputs["target_tokens"].astype(np.int64).reshape(-1)
            logprobs, sampled = np.zeros(n, np.float32), np.zeros(n, np.float32)
            for field, runs, values in (
                ("model_input_spans", pair[0], d.tokens),
                ("loss_fn_input_spans", pair[1], targets),
            ):
                total = sum(s.length for s in runs)
                if total != n or len(values) != n:
                    raise BadRequest(
                        f"datum {i}: {field} cover {total} positions but the field has {len(values)}; "
                        "the runs must tile it exactly"
                    )
                pos = 0
                for j, span in enumerate(runs):
                    rec = self._check(f"datum {i} {field}[{j}]", span, records, run, now)
                    source = rec.prompt if span.kind == "prompt" else rec.tokens
                    got = np.asarray(values[pos : pos + span.length], dtype=np.int64)
                    if not (field == "loss_fn_input_spans" and span.kind == "prompt"):  # placeholder targets
                        want = source[span.offset : span.offset + span.length].astype(np.int64)
                        bad = np.flatnonzero(got != want)
                        if bad.size:
                            k = int(bad[0])
                            raise BadRequest(
                                f"datum {i} {field}[{j}] ({span.kind}, sequence_id {span.sequence_id!r}): "
                                f"position {pos + k} is token {int(got[k])} but the recorded {span.kind} token "
                                f"{span.offset + k} is {int(want[k])}"
                            )
                    if field == "loss_fn_input_spans" and span.kind == "sampled":
                        logprobs[pos : pos + span.length] = rec.logprobs[span.offset : span.offset + span.length]
                        sampled[pos : pos + span.length] = 1.0
                        if rec.model_id == run.model_id:
                            lags.append(rec.policy_version)
                    pos += span.length
            out.append(Datum(d.tokens, {**d.inputs, "logprobs": logprobs, "sampled_mask": sampled}, d.images))
        self.store.stability.touch(ids, now)  # each training request that uses a sequence restarts its day
        metrics = {}
        if lags:
            metrics["policy_lag:max"] = float(self.version_of(run.model_id) - min(lags))
        return out, metrics

    def _check(self, where: str, span: Span, records: dict, run: Run, now: float) -> StabilityRecord:
        label = f"{where} ({span.kind}, sequence_id {span.sequence_id!r})"
        if span.kind == "empty":
            raise BadRequest(f"{where}: a provenance span with neither prompt_tokens nor sampled_tokens")
        if span.offset < 0 or span.length < 0:
            raise BadRequest(f"{label}: offset and length must be >= 0, got {span.offset}, {span.length}")
        rec = records.get(span.sequence_id)
        if rec is None:  # another tenant's sequence reads exactly like one that never existed
            raise BadRequest(
                f"{label}: unknown sequence: not sampled with record_stability_info by this key, or its "
                "record expired or was evicted"
            )
        if rec.session_id != run.session_id:
            raise BadRequest(f"{label}: the sequence was sampled by session {rec.session_id!r}, not this run's")
        if rec.last_used < now - self.ttl_s:
            raise BadRequest(
                f"{label}: the record expired ({now - rec.last_used:.0f} s unused; records expire after "
                f"{self.ttl_s:.0f} s without a training request)"
            )
        size = len(rec.prompt) if span.kind == "prompt" else len(rec.tokens)
        if span.offset + span.length > size:
            raise BadRequest(
                f"{label}: positions [{span.offset}, {span.offset + span.length}) are outside the sequence's "
                f"{'prompt' if span.kind == 'prompt' else 'sampled tokens'} (length {size})"
            )
        return rec
