"""Usage per API key and per training run, and the per-key quotas that refuse work past them.

Both APIs count here, where their work completes: training tokens (model input tokens of every
forward and forward_backward that succeeded), sampling prefill tokens (each prompt) and sampled
tokens (on a run too when the sampler was made from one of its checkpoints; an ephemeral sampler
of a run's live weights counts on the key only). Checkpoint bytes are read from the checkpoint records, so deleting or expiring a checkpoint
frees its share. Quotas (all optional, per key, kept in SQLite):
- `tokens_per_day`: tokens of every kind since 00:00 UTC; a request that would pass it answers 429
  with Retry-After until the day ends;
- `storage_bytes`: a save while the key's checkpoints hold that many bytes answers 409;
- `adapters`: a new adapter while the key holds that many live ones answers 409.
Every refusal's JSON body names the quota, its limit and what is used.
"""

from __future__ import annotations

import time

from twinkle.serve.core.records import Run, SamplingSession
from twinkle.serve.errors import ApiError

DAY = 24 * 3600
KINDS = ("training", "sampling_prefill", "sampling_sample")


class QuotaExceeded(ApiError):
    def __init__(
        self,
        tenant: str,
        quota: str,
        limit: int,
        used: int,
        status: int,
        wanted: int = 0,
        retry_after: int | None = None,
    ):
        more = f" (this request needs {wanted} more)" if wanted else ""
        # x-should-retry: false: the Tinker SDK would otherwise retry a 409 or 429 for minutes
        headers = {"x-should-retry": "false", **({"Retry-After": str(retry_after)} if retry_after else {})}
        super().__init__(
            f"key {tenant!r} is over its {quota} quota: {used} used of {limit}{more}; "
            "an operator raises it with `twinkle-server keys set-quota`",
            headers=headers,
        )
        self.status = status
        self.extra = {"quota": quota, "limit": limit, "used": used}


def _run_of(sampler: SamplingSession) -> str | None:
    """The training run a sampler's checkpoint came from (tinker://{model_id}/...), if any."""
    path = sampler.model_path or ""
    return path[len("tinker://") :].split("/", 1)[0] if path.startswith("tinker://") and "/" in path[9:] else None


class UsageLedger:
    def __init__(self, store):
        self.store = store

    # ---- counting ------------------------------------------------------------------------------
    def count_training(self, run: Run, tokens: int) -> None:
        self.store.usage.add(run.tenant, run.session_id, run.base_model, {"training": tokens}, run.model_id, soon=True)

    def count_sampling(self, sampler: SamplingSession, prompt_tokens: int, sampled_tokens: int) -> None:
        counts = {"sampling_prefill": prompt_tokens, "sampling_sample": sampled_tokens}
        self.store.usage.add(
            sampler.tenant, sampler.session_id, sampler.base_model, counts, _run_of(sampler), soon=True
        )

    # ---- quotas --------------------------------------------------------------------------------
    def check_tokens(self, tenant: str, tokens: int) -> None:
        limit = self.store.quotas.get(tenant)["tokens_per_day"]
        if limit is None:
            return
        now = time.time()
        day = now // DAY * DAY
        used = self.store.usage.since(tenant, day)
        if used + tokens > limit:
            raise QuotaExceeded(tenant, "tokens_per_day", limit, used, 429, tokens, int(day + DAY - now) + 1)

    def check_storage(self, tenant: str) -> None:
        limit = self.store.quotas.get(tenant)["storage_bytes"]
        if limit is not None and (used := self.store.quotas.bytes_stored(tenant)) >= limit:
            raise QuotaExceeded(tenant, "storage_bytes", limit, used, 409)

    def check_adapters(self, tenant: str, live: int) -> None:
        limit = self.store.quotas.get(tenant)["adapters"]
        if limit is not None and live >= limit:
            raise QuotaExceeded(tenant, "adapters", limit, live, 409, 1)

    # ---- reports (CLI `keys usage`, the dashboard) ---------------------------------------------
    def report(self, tenant: str) -> dict:
        totals = self.store.usage.totals(tenant)
        day = time.time() // DAY * DAY
        return {
            "tenant": tenant,
            "tokens": {k: totals.get(k, 0) for k in KINDS},
            "tokens_today": self.store.usage.since(tenant, day),
            "checkpoint_bytes": self.store.quotas.bytes_stored(tenant),
            "quotas": self.store.quotas.get(tenant),
            "runs": [
                {k: r[k] for k in ("model_id", "api", "training", "sampling", "checkpoint_bytes")}
                for r in self.store.usage.of_runs(tenant)
            ],
        }
