"""The native Twinkle API (/twinkle/v1) by hand, with bounded timeouts, for the reliability tests
(isolation matrix, limits, security); harness.Wire is its Tinker counterpart."""

from __future__ import annotations

import time

import httpx
from harness import HttpWire

PREFIX = "/twinkle/v1"
SEQ = [5 + (7 * i) % 60 for i in range(16)]


def native_row(tokens: list[int] = SEQ) -> dict:
    return {"input_ids": list(tokens), "labels": list(tokens)}


class NativeWire(HttpWire):
    prefix = PREFIX

    def wait(self, request_id: str, deadline_s: float = 120) -> dict:
        """A future's final FutureResult (status 'complete' or 'failed'); bounded in time."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            out = self.ok(self.get(f"/futures/{request_id}", params={"timeout": 10}))
            if out["status"] != "pending":
                return out
        raise TimeoutError(f"future {request_id} did not finish within {deadline_s} s")

    def done(self, r: httpx.Response, deadline_s: float = 120) -> dict:
        out = self.wait(self.ok(r)["request_id"], deadline_s)
        assert out["status"] == "complete", out
        return out["result"]

    def model(self, seed: int = 0) -> str:
        return self.ok(self.post("/models", {"seed": seed}))["model_id"]

    def add_adapter(self, model_id: str, name: str = "default", r: int = 4) -> httpx.Response:
        return self.post(
            f"/models/{model_id}/add_adapter_to_model",
            {"adapter_name": name, "lora_config": {"r": r, "lora_alpha": 2 * r}},
        )
