"""Tinker sampling: sampling sessions over a checkpoint, a base model, a training run's snapshot or its
inflight target (core/inflight.py), and asample."""

from __future__ import annotations

import hashlib
import time
import uuid

from twinkle.serve.backend import UserError
from twinkle.serve.core.checkpoints import sampler_adapter_name
from twinkle.serve.core.records import SamplingSession
from twinkle.serve.core.service import Service
from twinkle.serve.core.work import StoredAnswer
from twinkle.serve.errors import NotFound
from twinkle.serve.tinker import bodies as b
from twinkle.serve.tinker import codec, images, model_names, prompt_scores
from twinkle.serve.tinker.provenance import Provenance
from twinkle.serve.tinker.sample_params import prompt_tokens, sample_params


def sampler_name(key: str) -> str:
    return "s" + hashlib.sha1(key.encode()).hexdigest()[:16]


class TinkerSampling:
    def __init__(self, svc: Service):
        self.svc, self.rt = svc, svc.rt
        self.provenance = Provenance(svc)

    def create_sampling_session(self, tenant: str, body: b.CreateSamplingSessionBody) -> dict:
        session_id = self.svc.session(tenant, body.session_id).session_id
        model_path = body.model_path
        if model_path:
            ckpt = self.svc.checkpoints.readable(tenant, model_path, purpose="sample")
            base_model = self.rt.store.runs.of_checkpoint(ckpt).base_model
        else:
            base_model = model_names.engine(self.rt, body.base_model).entry.name
        sampler_id = f"{session_id}:sample:{body.sampling_session_seq_id}"
        self.svc.admit_sampler(tenant)
        self.rt.store.samplers.create(
            SamplingSession(sampler_id, tenant, session_id, base_model, model_path, time.time())
        )
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def install_ephemeral(self, tenant: str, engine, session_id: str, seq: int, model_id: str, kind: str) -> dict:
        """save_weights_for_sampler without a path: an ephemeral sampler on the run's current weights, a
        snapshot of them, or (kind "inflight") a session following the run's inflight target, which these
        weights become the next version of (core/inflight.py)."""
        sampler_id, live = f"{session_id}:sample:{seq}", self.svc.live_adapter(model_id)
        if kind == "inflight":
            steps = self.provenance.version_of(model_id)
            self.svc.inflight.publish(engine.backend, model_id, live, steps, sampler_id)
        else:
            engine.backend.install_sampler_from_adapter(sampler_name(sampler_id), live)
        self.rt.store.samplers.create(
            SamplingSession(sampler_id, tenant, session_id, engine.entry.name, None, time.time(), ephemeral=True)
        )
        self.provenance.snapshot(sampler_id, model_id)  # the policy version its samples are recorded with
        return {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}

    def sampler(self, tenant: str, sampler_id) -> SamplingSession:
        sampler = self.rt.store.samplers.owned(sampler_id, tenant)
        if sampler is None:
            raise NotFound(f"sampler {sampler_id!r} not found")
        return sampler

    def get_sampler(self, tenant: str, sampler_id: str) -> dict:
        s = self.sampler(tenant, sampler_id)
        return {"sampler_id": sampler_id, "base_model": s.base_model, "model_path": s.model_path}

    def asample(self, tenant: str, body: b.ASampleBody) -> dict:
        sampler = self.sampler(tenant, body.sampling_session_id)
        engine = self.rt.engine(sampler.base_model)
        (prompt, pieces), n = prompt_tokens(body.prompt.chunks), body.num_samples
        backend = engine.backend
        pixels = None
        if pieces:  # image chunks: the model's placeholder tokens in the prompt, the pixels beside it
            prompt, pixels = images.expand(prompt, pieces, backend, sampler.base_model, "prompt", self.rt.config.caps)
        hold = self.svc.admit_tokens(tenant, len(prompt))
        params, asks = sample_params(body, len(prompt), backend.vocab_size, backend.max_context, self.rt.config.caps)
        sequence_ids = [uuid.uuid4().hex for _ in range(n)]
        # stable_reinforce: what each sequence's loss will need, recorded before the result is visible
        policy = self.provenance.policy(tenant, sampler) if body.record_stability_info else None
        adapter = folder = namespace = None
        if self.svc.inflight.follows(sampler.sampler_id):
            namespace = sampler.sampler_id  # the session's own prefix-cache namespace; the adapter is read at run
        elif sampler.model_path:
            ckpt = self.svc.checkpoints.readable(tenant, sampler.model_path)
            adapter = sampler_adapter_name(ckpt)
            folder = str(self.svc.checkpoints.folder(ckpt))
        elif sampler.ephemeral:
            adapter = sampler_name(sampler.sampler_id)

        def run():
            if folder is not None and adapter is not None:  # set together, from a saved checkpoint
                engine.backend.install_sampler_from_folder(adapter, folder)
            used, policy_now = adapter, policy
            if namespace is not None:  # inflight: the target's newest version as this sample starts
                target = self.svc.inflight.newest(sampler.sampler_id)
                if target is None:
                    raise UserError("this inflight sampler's training model was unloaded; save weights for it again")
                used = target.adapter
                policy_now = None if policy is None else (target.model_id, target.policy_steps)
            response = engine.backend.sample(used, prompt, params, images=pixels, cache_namespace=namespace)
            result = prompt_scores.answer(engine.backend, used, prompt, response, asks, params, images=pixels)
            self.svc.count_sampling(sampler, len(prompt), sum(len(s.tokens) for s in result.sequences))
            if policy_now is not None:
                self.provenance.record(tenant, sampler, policy_now, sequence_ids, prompt, result.sequences)
            return StoredAnswer.proto(
                codec.encode_sample_result(result, asks.topk_prompt, asks.topk_sample, asks.target_layout)
            )

        seq = body.seq_id
        request_id = self.svc.submit(tenant, engine, sampler.sampler_id, seq, run, hold=hold, sliced=True)
        # a clone's seq_ids start at clone * 1e9: the retrieve_futures queue it reads (tinker/sampling_queue.py)
        clone = 0 if seq is None else seq // 10**9
        self.rt.store.sample_requests.record(request_id, tenant, sampler.sampler_id, clone)
        return {"request_id": request_id, "sample_sequence_ids": sequence_ids}
