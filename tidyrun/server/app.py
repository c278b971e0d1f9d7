"""The FastAPI application: OpenAI-compatible routes, lifecycle routes, metrics, errors.

The lifecycle and admin routes (sleep, wake, weight updates, prefix-cache
reset, shutdown) change or stop what every client is served, so they are not
part of the default surface: as vLLM keeps them behind its dev-mode switch,
they exist only with ``enable_lifecycle_endpoints`` and then always need an
admin key. Weight updates read only from one folder the operator names.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import (EngineShutdownError, EngineSleepingError, InvalidRequestError, ModelLoadError,
                      TidyrunError)
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .choices import ChatChoices, CompletionChoices
from ..engine_loop import EngineLoop, Submission
from .logprobs_format import TokenIdText, TokenText
from .metrics import ServerMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                       TokenizeRequest, UpdateWeightsRequest)

_DISCONNECT_POLL_S = 0.25


class APIError(Exception):
    """An error with an HTTP status and an OpenAI error type."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _error_body(status: int, message: str, type_: str, param=None, code=None) -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": type_, "param": param, "code": code}})


def _as_api_error(exc: TidyrunError) -> APIError:
    if isinstance(exc, EngineSleepingError):
        return APIError(409, str(exc), "engine_sleeping")
    if isinstance(exc, EngineShutdownError):
        return APIError(503, str(exc), "service_unavailable")
    if isinstance(exc, (InvalidRequestError, ModelLoadError)):
        return APIError(400, str(exc))
    return APIError(400, f"{type(exc).__name__}: {exc}")


def admin_key_of(enable_lifecycle_endpoints: bool = False, api_key: str | None = None,
                 admin_key: str | None = None, weights_dir: str | None = None,
                 enable_shutdown_endpoint: bool = False) -> str | None:
    """The key the lifecycle routes require (None: they are off), or ValueError naming the options at fault.

    Checked before anything is built (the CLI calls it before loading the
    model), and refusing combinations that would do nothing: an admin key,
    a weights dir or a shutdown route without the lifecycle switch would
    otherwise be silently ignored, and the switch without any key would
    let anyone who reaches the port sleep, overwrite or stop the model.
    """
    if not enable_lifecycle_endpoints:
        for given, option in ((admin_key is not None, "admin_key (--admin-key)"),
                              (weights_dir is not None, "weights_dir (--weights-dir)"),
                              (enable_shutdown_endpoint, "POST /shutdown (--enable-shutdown-endpoint)")):
            if given:
                raise ValueError(f"{option} needs enable_lifecycle_endpoints (--enable-lifecycle-endpoints): "
                                 "without it the lifecycle and admin routes do not exist")
        return None
    key = admin_key if admin_key is not None else api_key
    if key is None:
        raise ValueError("enable_lifecycle_endpoints (--enable-lifecycle-endpoints) needs a key: give admin_key "
                         "(--admin-key) or api_key (--api-key); the lifecycle routes are never served "
                         "without authentication")
    if not key:
        raise ValueError(f"{'admin_key (--admin-key)' if admin_key is not None else 'api_key (--api-key)'} "
                         "must not be empty: it is the key of the lifecycle routes")
    if weights_dir is not None and not os.path.isdir(weights_dir):
        raise ValueError(f"weights_dir (--weights-dir) {weights_dir!r} is not an existing folder")
    return key


def _route_label(request: Request) -> str:
    """The metrics label of a request: its route's path template, or "unmatched" for a path no route serves
    (a label per raw path would let any client grow /metrics without bound with made-up URLs)."""
    route = request.scope.get("route")
    return getattr(route, "path", None) or "unmatched"


def _inside(path: str, root: str) -> bool:
    """Whether the resolved ``path`` is ``root`` or below it (both already passed through realpath)."""
    return os.path.commonpath([path, root]) == root


def _read_update(files: list[str], root: str, check_finite: bool) -> dict:
    """Every tensor of ``files`` in host memory, by name, refused as a whole if one is unreadable, repeated or
    (``check_finite``) not finite.

    A dict, not an iterator, goes to the engine: it checks a mapping's names,
    shapes and dtypes completely before copying any of it, so a bad later
    shard cannot leave the model half-updated. The price is holding the
    whole update in host memory while it is checked and copied.
    """
    import torch

    from ..loader.hf import iter_safetensors

    weights: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for path in files:
        shard = os.path.relpath(path, root)
        for name, tensor in iter_safetensors([path]):
            if name in weights:
                raise InvalidRequestError(f"update_weights: tensor {name!r} is in both {origin[name]!r} and "
                                          f"{shard!r}; nothing was updated")
            if check_finite and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise InvalidRequestError(f"update_weights: tensor {name!r} in {shard!r} holds NaN or infinite "
                                          "values (check_finite); nothing was updated")
            weights[name], origin[name] = tensor, shard
    return weights


def create_app(loop: EngineLoop, served_model_name: str, api_key: str | None = None,
               request_exit: Callable[[], None] | None = None, *, enable_lifecycle_endpoints: bool = False,
               admin_key: str | None = None, weights_dir: str | None = None,
               trust_request_chat_template: bool = False) -> FastAPI:
    """Build the app around a started-on-startup EngineLoop.

    ``api_key`` guards the /v1 routes. ``enable_lifecycle_endpoints`` adds
    POST /sleep, /wake_up, /reset_prefix_cache, GET /is_sleeping, and (with
    ``weights_dir``) POST /update_weights, reading only below that folder;
    ``request_exit`` adds POST /shutdown, and needs the switch as well.
    ``trust_request_chat_template``: a chat request may bring its own ``chat_template`` (refused otherwise,
    as vLLM refuses it without --trust-request-chat-template).
    Every one of them needs ``admin_key`` (or, without one, ``api_key``);
    without the switch they answer 404 like any unknown path. Raises
    ValueError naming the options for a combination that would leave them
    unauthenticated or would be ignored (see ``admin_key_of``).
    """
    lifecycle_key = admin_key_of(enable_lifecycle_endpoints, api_key, admin_key, weights_dir,
                                 request_exit is not None)
    weights_root = os.path.realpath(weights_dir) if weights_dir is not None else None
    llm = loop.llm
    tokenizer = llm.tokenizer
    max_model_len = llm.max_model_len
    vocab = llm.runner.model_config.vocab_size
    token_text, token_id_text = TokenText(tokenizer), TokenIdText(tokenizer)
    metrics = ServerMetrics(loop)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not loop.running:
            loop.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, loop.stop)

    app = FastAPI(title="tidyrun", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        metrics.count(_route_label(request), exc.status)
        return _error_body(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        metrics.count(_route_label(request), 400)
        parts, param = [], None
        for err in exc.errors()[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            unknown = err.get("type") == "extra_forbidden"
            msg = "unknown field: tidyrun does not support it" if unknown else err.get("msg")
            parts.append(f"{loc}: {msg}" if loc else str(msg))
            param = param or loc or None
        return _error_body(400, "invalid request: " + "; ".join(parts), "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        metrics.count(_route_label(request), exc.status_code)
        return _error_body(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(TidyrunError)
    async def _tidyrun_error(request: Request, exc: TidyrunError):
        err = _as_api_error(exc)
        metrics.count(_route_label(request), err.status)
        return _error_body(err.status, err.message, err.type)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # A bug, not a bad request: answer in OpenAI's shape; Starlette also logs the traceback.
        metrics.count(_route_label(request), 500)
        return _error_body(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")

    def bearer_matches(request: Request, key: str) -> bool:
        header = request.headers.get("authorization", "").encode()
        return hmac.compare_digest(header, f"Bearer {key}".encode())  # constant time: no key guessing by timing

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        if not bearer_matches(request, api_key):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           "authentication_error", code="invalid_api_key")

    async def check_admin(request: Request) -> None:
        """Runs before the body and query are validated, so a caller without the key learns nothing else."""
        if not bearer_matches(request, lifecycle_key):
            raise APIError(401, "invalid or missing admin key: lifecycle routes need 'Authorization: Bearer "
                           "<admin key>' (the server's --admin-key, or its --api-key when no admin key is set)",
                           "authentication_error", code="invalid_api_key")

    def chat_ids(body, conversation: list[dict]) -> list[int]:
        """The token ids of ``conversation`` rendered as ``body`` (chat or /tokenize) asks. A request's own
        template (``chat_template``, or one slipped in through ``chat_template_kwargs``, which override the
        named arguments) only on a trusting server; tools only as the tools field, which is refused."""
        kwargs = body.chat_template_kwargs or {}
        if (body.chat_template is not None or "chat_template" in kwargs) and not trust_request_chat_template:
            raise APIError(400, "chat_template: this server does not run templates sent with a request; start it "
                           "with --trust-request-chat-template to allow them", "invalid_request_error",
                           "chat_template")
        if "tools" in kwargs:
            raise APIError(400, "tools are not supported by tidyrun (chat_template_kwargs.tools)",
                           "invalid_request_error", "chat_template_kwargs")
        return tokenizer.apply_chat_template(conversation, body.add_generation_prompt,
                                             continue_final_message=body.continue_final_message,
                                             chat_template=body.chat_template,
                                             template_kwargs=body.chat_template_kwargs,
                                             add_special_tokens=bool(body.add_special_tokens))

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {served_model_name!r}",
                           code="model_not_found", param="model")

    def budget(prompt_len: int, requested: int | None) -> int:
        room = max_model_len - prompt_len
        if room < 1:
            raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                           f"{prompt_len} tokens and leaves no room to generate", param="prompt")
        if requested is None:
            return room
        if requested > room:
            raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                           f"{prompt_len} tokens and max_tokens asks for {requested} more", param="max_tokens")
        return requested

    def encode(prompt, add_special_tokens: bool | None = None) -> list[int]:
        if isinstance(prompt, dict):
            ids = prompt["prompt_token_ids"]
            if not all(0 <= t < vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            return ids
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens is not False)

    def truncate(ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the last ``keep`` tokens (-1: as many as fit with one more)."""
        if keep is None:
            return ids
        keep = max_model_len - 1 if keep == -1 else keep
        return ids[-keep:] if len(ids) > keep else ids

    async def submit_all(requests: list[tuple[list[int], SamplingParams]], stream: bool) -> list[Submission]:
        """Submit every request and wait until the engine has accepted them all; if it refuses one, the
        others are aborted and its error is raised, so a request is answered whole or not at all."""
        subs: list[Submission] = []
        try:
            for ids, params in requests:
                subs.append(loop.submit({"prompt_token_ids": ids}, params, stream=stream))
            for sub in subs:
                await sub.accepted()
        except BaseException:
            for sub in subs:
                sub.close()
            raise
        return subs

    async def run_to_end(request: Request, subs: list[Submission]) -> list[RequestOutput]:
        """The final outputs of accepted requests; a client that disconnects meanwhile aborts them."""
        async def final(sub: Submission) -> RequestOutput:
            last = None
            async for out in sub:
                last = out
            return last

        tasks = [asyncio.ensure_future(final(sub)) for sub in subs]
        try:
            while True:
                done, pending = await asyncio.wait(tasks, timeout=_DISCONNECT_POLL_S,
                                                   return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    task.result()  # a failed request fails the call (the others are aborted below)
                if not pending:
                    return [task.result() for task in tasks]
                if await request.is_disconnected():
                    raise asyncio.CancelledError
        finally:
            for task in tasks:
                task.cancel()
            for sub in subs:
                sub.close()

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def stream_choices(sub: Submission, prompt_len: int, choices, envelope: Callable[[list], dict],
                             include_usage: bool, opening: list[dict] = (),
                             continuous: bool = False) -> AsyncIterator[str]:
        """SSE chunks (``envelope(choice deltas)``) of every choice's progress per step; ``[DONE]`` at the end.
        ``continuous`` (vLLM's continuous_usage_stats): each chunk also carries the usage so far."""
        done: set[int] = set()
        last = None
        so_far = 0  # tokens generated so far, all choices

        def chunk(deltas: list) -> str:
            body = envelope(deltas)
            return sse(body | {"usage": usage(prompt_len, so_far)} if continuous else body)

        try:
            for choice in opening:
                yield chunk([choice])
            async for out in sub:
                last = out
                so_far = sum(len(choices.generated(c)[1]) for c in out.outputs)
                for c in out.outputs:
                    if c.index in done:
                        continue
                    delta = choices.delta(out, c)
                    if delta is not None:
                        yield chunk([delta])
                    if c.finished():
                        done.add(c.index)
        finally:
            sub.close()
        if last is not None:
            n_out = sum(len(choices.generated(c)[1]) for c in last.outputs)
            metrics.tokens(prompt_len, n_out)
            if include_usage:
                yield sse(envelope([]) | {"usage": usage(prompt_len, n_out)})
        yield "data: [DONE]\n\n"

    # -- OpenAI routes -----------------------------------------------------------------

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def list_models():
        metrics.count("/v1/models", 200)
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "tidyrun", "max_model_len": max_model_len}]}

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompts, prompt_texts = [], []
        for item in body.prompts():
            full = encode(item, body.add_special_tokens)
            ids = truncate(full, body.truncate_prompt_tokens)
            prompts.append(ids)
            # echo shows the prompt as sent; one given as token ids (or truncated) is shown decoded
            prompt_texts.append("" if not body.echo else item if isinstance(item, str) and len(ids) == len(full)
                                else tokenizer.decode(ids, skip_special_tokens=False))
        if body.stream and len(prompts) != 1:
            raise APIError(400, "streaming supports one prompt per request", param="prompt")
        score_only = body.max_tokens == 0  # echo with max_tokens=0: one token is generated, then dropped
        requests = [(ids, body.params(budget(len(ids), 1 if score_only else body.max_tokens))) for ids in prompts]
        subs = await submit_all(requests, body.stream)
        created, rid, model = int(time.time()), f"cmpl-{uuid.uuid4().hex}", served_model_name

        def choices_of(k: int) -> CompletionChoices:
            return CompletionChoices(token_id_text if body.return_tokens_as_token_ids else token_text,
                                     requests[k][1].stop, body.logprobs, body.prompt_logprobs, body.echo,
                                     prompt_texts[k], score_only, bool(body.return_token_ids))

        if body.stream:
            def envelope(deltas: list) -> dict:
                return {"id": rid, "object": "text_completion", "created": created, "model": model,
                        "choices": deltas}

            metrics.count("/v1/completions", 200)
            return StreamingResponse(stream_choices(subs[0], len(prompts[0]), choices_of(0), envelope,
                                                    body.include_usage, continuous=body.continuous_usage),
                                     media_type="text/event-stream")
        outs = await run_to_end(request, subs)
        choices, completion_tokens = [], 0
        for k, out in enumerate(outs):
            builder = choices_of(k)
            for c in out.outputs:
                choices.append(builder.whole(out, c, k * body.n + c.index))
                completion_tokens += len(builder.generated(c)[1])
        prompt_tokens = sum(len(ids) for ids in prompts)
        metrics.tokens(prompt_tokens, completion_tokens)
        metrics.count("/v1/completions", 200)
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens)}

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        ids = truncate(chat_ids(body, body.conversation()), body.truncate_prompt_tokens)
        params = body.params(budget(len(ids), body.requested_max_tokens))
        (sub,) = await submit_all([(ids, params)], body.stream)
        choices = ChatChoices(token_id_text if body.return_tokens_as_token_ids else token_text, params.stop,
                              body.num_top_logprobs, body.prompt_logprobs, bool(body.return_token_ids))
        created, rid, model = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}", served_model_name
        if body.stream:
            first = [True]

            def envelope(deltas: list) -> dict:
                chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                         "choices": deltas}
                if body.return_token_ids:  # vLLM: the prompt's ids in the first chunk only
                    chunk["prompt_token_ids"], first[0] = (list(ids) if first[0] else None), False
                return chunk

            opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(params.n)]
            metrics.count("/v1/chat/completions", 200)
            return StreamingResponse(stream_choices(sub, len(ids), choices, envelope, body.include_usage, opening,
                                                    continuous=body.continuous_usage),
                                     media_type="text/event-stream")
        (out,) = await run_to_end(request, [sub])
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        metrics.tokens(len(ids), completion_tokens)
        metrics.count("/v1/chat/completions", 200)
        response = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                    "choices": [choices.whole(c) for c in out.outputs], "usage": usage(len(ids), completion_tokens)}
        if body.prompt_logprobs is not None:
            response["prompt_logprobs"] = choices.prompt_logprobs(out)
        if body.return_token_ids:
            response["prompt_token_ids"] = list(out.prompt_token_ids)
        return response

    @app.post("/v1/embeddings", dependencies=[Depends(check_key)])
    async def embeddings(body: EmbeddingRequest):
        import base64

        import numpy as np

        check_model(body.model)
        token_lists = [encode({"prompt_token_ids": x}) if isinstance(x, list) else encode(x) for x in body.inputs()]
        for ids in token_lists:
            if not ids or len(ids) > max_model_len:
                raise APIError(400, f"each input must have 1 to {max_model_len} tokens, got {len(ids)}", param="input")
        outs = await loop.call(lambda e: e.embed(token_lists, pooling=body.pooling, normalize=body.normalize))
        data = []
        for i, out in enumerate(outs):
            v = out.outputs.embedding
            emb = (base64.b64encode(np.asarray(v, dtype=np.float32).tobytes()).decode()
                   if body.encoding_format == "base64" else v)
            data.append({"object": "embedding", "index": i, "embedding": emb})
        n_tokens = sum(len(ids) for ids in token_lists)
        metrics.tokens(n_tokens, 0)
        metrics.count("/v1/embeddings", 200)
        return {"object": "list", "data": data, "model": served_model_name,
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}

    # vLLM's tokenizer routes (outside /v1, as vLLM serves them): what a prompt costs in tokens before sending it
    @app.post("/tokenize", dependencies=[Depends(check_key)])
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        body.check()
        if body.messages is not None:
            ids = chat_ids(body, [m.as_template_message() for m in body.messages])
        else:
            ids = encode(body.prompt, body.add_special_tokens)
        metrics.count("/tokenize", 200)
        strs = tokenizer.hf_tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", dependencies=[Depends(check_key)])
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        if not all(0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        metrics.count("/detokenize", 200)
        return {"prompt": tokenizer.decode(body.tokens)}

    # -- health, metrics, lifecycle ----------------------------------------------------

    @app.get("/health")
    async def health():
        """200 while the engine thread serves; 503 saying why not (it died: the error; or it is stopping)."""
        reason = loop.unhealthy
        if reason is not None:
            raise APIError(503, f"engine is not serving: {reason}", "service_unavailable")
        return {"status": "ok", "sleeping": loop.stats.values.get("sleeping", False)}

    @app.get("/version")
    async def version():
        from .. import __version__

        return {"version": __version__}

    @app.get("/ping")
    async def ping():
        """vLLM's (SageMaker's) liveness probe: /health's answer."""
        return await health()

    @app.post("/ping")
    async def ping_post():
        """/ping by POST, as vLLM also answers it."""
        return await health()

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    if enable_lifecycle_endpoints:
        _add_lifecycle_routes(app, loop, metrics, check_admin, weights_root, request_exit)

    return app


def _add_lifecycle_routes(app: FastAPI, loop: EngineLoop, metrics: ServerMetrics, check_admin: Callable,
                          weights_root: str | None, request_exit: Callable[[], None] | None) -> None:
    """POST /sleep, /wake_up, /reset_prefix_cache, /start_profile, /stop_profile, GET /is_sleeping;
    /update_weights with a weights dir; /shutdown with ``request_exit``. All behind ``check_admin``."""
    admin = [Depends(check_admin)]

    @app.post("/sleep", dependencies=admin)
    async def sleep(level: int = Query(1, ge=1, le=2)):
        freed = await loop.call(lambda e: e.sleep(level))
        metrics.count("/sleep", 200)
        return {"sleeping": True, "level": level, "freed_bytes": freed}

    @app.post("/wake_up", dependencies=admin)
    async def wake_up(tags: list[str] | None = Query(None)):
        def wake(e):
            e.wake_up(tags)
            return e.is_sleeping

        still_sleeping = await loop.call(wake)
        metrics.count("/wake_up", 200)
        return {"sleeping": still_sleeping}

    @app.get("/is_sleeping", dependencies=admin)
    async def is_sleeping():
        return {"is_sleeping": await loop.call(lambda e: e.is_sleeping)}

    @app.post("/reset_prefix_cache", dependencies=admin)
    async def reset_prefix_cache(reset_running_requests: bool = Query(False), reset_external: bool = Query(False)):
        # vLLM's query parameters: running requests preempted (they recompute) instead of a refusal; no
        # external (connector) cache exists here, so reset_external has nothing more to reset.
        if not await loop.call(lambda e: e.reset_prefix_cache(reset_running_requests)):
            raise APIError(409, "the prefix cache was not reset: requests are in flight (as in vLLM, it is reset "
                           "only while the engine is idle); retry when they are done, or pass "
                           "?reset_running_requests=true to preempt them", "conflict")
        metrics.count("/reset_prefix_cache", 200)
        return {"reset": True}

    # vLLM's profiling routes: the engine's start_profile / stop_profile (on its thread, where its steps run),
    # as LLM(profiler_config=) or VLLM_TORCH_PROFILER_DIR configured it; a 400 naming the fix otherwise.
    @app.post("/start_profile", dependencies=admin)
    async def start_profile():
        await loop.call(lambda e: e.start_profile())
        metrics.count("/start_profile", 200)
        return {"profiling": True}

    @app.post("/stop_profile", dependencies=admin)
    async def stop_profile():
        trace = await loop.call(lambda e: e.stop_profile())
        metrics.count("/stop_profile", 200)
        return {"profiling": False, "trace": trace}

    if weights_root is not None:
        def update_files(raw: str) -> list[str]:
            """The .safetensors files ``raw`` names, resolved; 403 if it or any of them leads outside the dir."""
            from ..loader.hf import safetensors_files

            outside = APIError(403, f"path {raw!r} is outside the server's weights dir (--weights-dir {weights_root!r}"
                               "); updates are read only from below it, after resolving '..' and symbolic links",
                               "permission_error", param="path", code="path_not_allowed")
            try:
                os.fsencode(raw)  # a lone surrogate (valid JSON) cannot name a file
            except UnicodeError:
                raw = ""
            if not raw or "\x00" in raw:
                raise APIError(400, "path must be a non-empty file system path (no NUL or unencodable characters)",
                               param="path")
            path = os.path.realpath(os.path.join(weights_root, raw))  # an absolute ``raw`` replaces the root here
            if not _inside(path, weights_root):
                raise outside  # before looking at it: outside paths are not probed for existence
            if not os.path.exists(path):
                raise APIError(400, f"path {raw!r} does not exist in the weights dir (--weights-dir {weights_root!r})",
                               param="path", code="path_not_found")
            files = [os.path.realpath(f) for f in safetensors_files(path)]
            if not all(_inside(f, weights_root) for f in files):
                raise outside  # a folder inside whose files link out
            return files

        @app.post("/update_weights", dependencies=admin)
        async def update_weights(body: UpdateWeightsRequest):
            files = update_files(body.path)
            # Reading shards takes seconds for big models: off the event loop, so other requests keep flowing.
            weights = await run_in_threadpool(_read_update, files, weights_root, body.check_finite)
            loaded = await loop.call(lambda e: e.update_weights(weights))
            metrics.count("/update_weights", 200)
            return {"updated": loaded, "files": len(files)}

    if request_exit is not None:
        @app.post("/shutdown", dependencies=admin)
        async def shutdown():
            request_exit()
            return {"shutting_down": True}
