"""`/v1/models`, `/v1/chat/completions`, `/v1/completions`: OpenAI's wire format over the service core.

The bearer token is the tenant's `tml-` key (X-API-Key works too). `stream=true` sends OpenAI's
server-sent-event chunks while the tokens are decoded (see generate.stream).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

import twinkle.serve.openai.responses as responses
from twinkle.sampler import SamplingParams
from twinkle.serve.auth import API_KEY
from twinkle.serve.core import bounds
from twinkle.serve.core.service import Service
from twinkle.serve.errors import BadRequest
from twinkle.serve.openai.bodies import ChatRequest, CompletionRequest
from twinkle.serve.openai.errors import OpenAIError, OpenAIRoute
from twinkle.serve.openai.generate import generate, stream
from twinkle.serve.openai.images import image_prompt
from twinkle.serve.openai.models import ModelResolver
from twinkle.serve.openai.text import render

BEARER = HTTPBearer(
    auto_error=False,
    scheme_name="OpenAIBearer",
    description="The tenant's `tml-` key as the bearer token (the OpenAI clients' api_key)",
)


def build_openai_router(svc: Service) -> APIRouter:
    rt = svc.rt
    models = ModelResolver(svc)
    router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)

    def tenant(
        bearer: HTTPAuthorizationCredentials | None = Security(BEARER), key: str | None = Security(API_KEY)
    ) -> str:
        name = rt.keys.tenant_for(bearer.credentials if bearer else key)
        if name is None:
            raise OpenAIError(
                401,
                "Incorrect or missing API key: send a key made with `twinkle-server keys create "
                "NAME` as `Authorization: Bearer tml-...`",
                code="invalid_api_key",
            )
        rt.limits.request(name)
        return name

    def ready(name: str = Depends(tenant)) -> str:
        rt.require_ready()
        return name

    @router.get("/models")
    def list_models(name: str = Depends(ready)) -> dict:
        return {"object": "list", "data": models.listing(name)}

    @router.get("/models/{model:path}")
    def get_model(model: str, name: str = Depends(ready)) -> dict:
        models.resolve(name, model)
        return next(m for m in models.listing(name) if model in (m["id"], m.get("name")))

    def params(
        body: ChatRequest | CompletionRequest, target, prompts: list[list[int]], top: int, max_tokens: int | None
    ) -> SamplingParams:
        """The request's options as the sampler's (max_tokens None: what the context leaves beside the
        longest prompt, which `cost` checked there is room for)."""
        room = target.engine.backend.max_context - max(len(p) for p in prompts)
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else room,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=list[str | int](body.stop_list() or []) or None,
            num_samples=body.n,
            logprobs=top or True,
        )

    def cost(target, prompts: list[list[int]], n: int, max_tokens: int | None, field: str) -> None:
        """max_tokens within the context and tokens x samples under the cap, as OpenAI's 400 naming `field`."""
        try:
            bounds.sample_cost(
                [len(p) for p in prompts], n, max_tokens, target.engine.backend.max_context, rt.config.caps, field
            )
        except BadRequest as e:
            raise OpenAIError(400, e.message, field) from None

    @router.post("/chat/completions")
    async def chat(body: ChatRequest, name: str = Depends(ready)):
        target = models.resolve(name, body.model)
        if body.top_logprobs and not body.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        tokenizer = target.engine.backend.tokenizer
        bounds.prompt_chars("messages", body.prompt_chars(), rt.config.caps)  # tokenized here, on the event loop
        args = (tokenizer, body, target.engine.backend, rt.config.caps)
        if any(m.has_images() for m in body.messages):  # images decode on the pool, never on the loop
            prompt, images = await run_in_threadpool(chat_prompt, *args)
        else:
            prompt, images = chat_prompt(*args)
        limit_field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        cost(target, [prompt], body.n, body.limit(), limit_field)
        sample = params(body, target, [prompt], body.top_logprobs or 0, body.limit())
        if body.stream:
            chunks = responses.ChatChunks(tokenizer, body)
            return await stream(svc, name, target, [prompt], body.n, sample, chunks, images=images)
        (result,) = await generate(svc, name, target, [prompt], body.n, sample, images=images)
        rendered = [render(tokenizer, s, body.stop_list()) for s in result.sequences]
        return responses.chat_completion(tokenizer, body, rendered, responses.usage([prompt], [result]))

    @router.post("/completions")
    async def completions(body: CompletionRequest, name: str = Depends(ready)):
        target = models.resolve(name, body.model)
        tokenizer = target.engine.backend.tokenizer
        bounds.prompt_chars("prompt", body.prompt_chars(), rt.config.caps)
        prompts = completion_prompts(tokenizer, body.prompt)
        cost(target, prompts, body.n, body.max_tokens, "max_tokens")
        sample = params(body, target, prompts, body.logprobs or 0, body.max_tokens)
        if body.stream:
            return await stream(svc, name, target, prompts, body.n, sample, responses.CompletionChunks(tokenizer, body))
        results = await generate(svc, name, target, prompts, body.n, sample)
        rendered = [render(tokenizer, s, body.stop_list()) for r in results for s in r.sequences]
        return responses.completion(tokenizer, body, rendered, responses.usage(prompts, results))

    return router


def chat_prompt(tokenizer, body: ChatRequest, backend=None, caps=None) -> tuple[list[int], dict | None]:
    """(the prompt's ids, its images' pixels or None); `caps`: the server's, which bound its images."""
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(400, f"model {body.model!r} has no chat template; use /v1/completions", "messages")
    if backend is not None and any(m.has_images() for m in body.messages):
        chat = [{"role": _role(m.role), "content": m.template_content()} for m in body.messages]
        return image_prompt(backend, chat, caps)
    messages = [{"role": _role(m.role), "content": m.text()} for m in body.messages]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"], None


def _role(role: str) -> str:
    return "system" if role == "developer" else role


def completion_prompts(tokenizer, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt is empty", "prompt")
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return [p if isinstance(p, list) else tokenizer(p)["input_ids"] for p in prompt]
