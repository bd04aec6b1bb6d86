"""The FastAPI app: llama-cpp-python's server, with its generation routes driven through one model thread.

llama-cpp-python's app (``llama_cpp.server.app``) is reused: its router (models, tokenize, detokenize), request
types, authentication, request-resource preparation and middleware. Its dependencies are overridden per app
(``app.dependency_overrides``), not patched. Two routes are served here instead, ``/v1/chat/completions`` and
``/v1/completions``, for three reasons:

- **One thread.** Every call into the model runs on a single worker thread. llama-cpp-python iterates a stream in
  the anyio thread pool, where consecutive chunks may run on different threads; a ``kvp_cpp.Llama`` refuses a second
  thread while a ``generate()`` is unfinished.
- **Cancelled streams.** When a client goes away mid-stream, the generator is closed explicitly on that thread
  (shielded from the cancellation) before the model lock is released, so the turn is recorded from the tokens
  actually evaluated and the ledger, the token history and the conversation store agree.
- **KV stats per response.** Non-streamed responses carry ``x-kv-*`` headers; a stream's last chunk carries a
  ``kv_stats`` object. ``GET /kv/stats`` reports the cache, the conversation store and the latest turn;
  ``GET /kv/cache`` lists the live conversation's cached tokens.

Every 5 seconds, after a response, the model's thread collects reference cycles and returns freed heap to the
system, so that memory stays flat between Python's rare full collections (each request's objects survive the
young-generation collections made while it runs, and the ones in cycles then wait for a full collection).

The embeddings route is left out: a policy-driven model generates and does not embed.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import gc
import json
import re
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple, Union

import anyio
import llama_cpp
from fastapi import APIRouter, Body, Depends, FastAPI, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.middleware import Middleware
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from jinja2 import TemplateError
from llama_cpp.server import app as llama_app
from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask
from starlette_context.middleware import RawContextMiddleware
from starlette_context.plugins import RequestIdPlugin

from .model import KvpLlamaProxy
from .settings import KvpModelSettings, KvpServerSettings, KvpSettings

_REPLACED_PATHS = {"/v1/chat/completions", "/v1/completions", "/v1/engines/copilot-codex/completions",
                   "/v1/embeddings"}  # fmt: skip
_TOO_LONG = re.compile(r"Requested tokens \((\d+)\) exceed")
_CLIENT_ERRORS = (ValueError, TemplateError)  # raised by llama-cpp-python for requests it cannot serve
TIDY_SECONDS = 5.0


class ModelWorker:
    """A single thread that runs every call into the model, in submission order."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvp-model")

    async def run(self, function, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(function, *args, **kwargs))

    async def run_shielded(self, function, *args, **kwargs):
        """Runs to the end even if the calling task is being cancelled."""
        with anyio.CancelScope(shield=True):
            return await self.run(function, *args, **kwargs)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


def tidy_memory() -> None:
    """Collects reference cycles (llama-cpp-python's samplers sit in some, with their native buffers, until a full
    collection) and hands freed heap pages back to the system (glibc keeps them otherwise)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


class ServerState:
    """What the routes share: the model, its thread, the request lock and the settings."""

    def __init__(self, proxy: KvpLlamaProxy, server_settings: KvpServerSettings, model_settings: KvpModelSettings):
        self.proxy = proxy
        self.server_settings = server_settings
        self.model_settings = model_settings
        self.worker = ModelWorker()
        self.lock = anyio.Lock()
        self.waiting = 0  # requests waiting for the lock (interrupt_requests)
        self.tidied = time.monotonic()
        self.tidies = 0
        self.tidy_seconds = 0.0

    async def tidy(self) -> None:
        """tidy_memory() on the model's thread once every TIDY_SECONDS, after a response has gone out."""
        if time.monotonic() - self.tidied >= TIDY_SECONDS:
            self.tidied = time.monotonic()
            await self.worker.run(tidy_memory)
            self.tidies += 1
            self.tidy_seconds += time.monotonic() - self.tidied

    @contextlib.asynccontextmanager
    async def hold(self):
        """The model, for one request at a time (a stream holds it until it ends)."""
        self.waiting += 1
        try:
            await self.lock.acquire()
        finally:
            self.waiting -= 1
        try:
            yield self.proxy
        finally:
            self.lock.release()


def _state(request: Request) -> ServerState:
    return request.app.state.kvp


async def _hold_model(request: Request):
    async with _state(request).hold() as proxy:
        yield proxy


def _server_settings(request: Request):
    return _state(request).server_settings


def error_response(request: Request, error: Exception) -> Tuple[int, Dict[str, Any]]:
    """OpenAI-style error bodies: 400 for requests the model cannot serve, 500 for the rest."""
    if isinstance(error, HTTPException):
        return error.status_code, {"message": str(error.detail), "type": "invalid_request_error", "param": None,
                                   "code": None}  # fmt: skip
    message = str(error)
    too_long = _TOO_LONG.search(message)
    if too_long:
        limit = _state(request).model_settings.kv_max_tokens
        return 400, {"message": f"This conversation needs {too_long.group(1)} tokens; this server keeps at most "
                                f"{limit} tokens of history (kv_max_tokens). The KV cache itself is bounded by "
                                "kv_budget; start a new conversation or raise kv_max_tokens.",
                     "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}  # fmt: skip
    if isinstance(error, _CLIENT_ERRORS):
        return 400, {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    if any(frame.filename == "<template>" for frame in traceback.extract_tb(error.__traceback__)):
        return 400, {"message": f"the model's chat template cannot render these messages: {message}",
                     "type": "invalid_request_error", "param": "messages", "code": None}  # fmt: skip
    print(f"Exception: {message}", file=sys.stderr)
    traceback.print_exception(error, file=sys.stderr)
    return 500, {"message": message, "type": "internal_server_error", "param": None, "code": None}


class KvpRoute(APIRoute):
    """Like llama-cpp-python's ``RouteErrorHandler``, but request validation errors stay 422 (its handler reads
    the body again and answers 500 for a malformed one) and errors from the model map to 400 or 500."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            start = time.perf_counter()
            try:
                response = await handler(request)
            except (HTTPException, RequestValidationError):
                raise
            except Exception as error:
                code, body = error_response(request, error)
                return JSONResponse({"error": body}, status_code=code)
            response.headers["openai-processing-ms"] = str(int((time.perf_counter() - start) * 1000))
            return response

        return route


router = APIRouter(route_class=KvpRoute)
_authenticated = [Depends(llama_app.authenticate)]


def kv_headers(report: Dict[str, Any]) -> Dict[str, str]:
    return {f"x-kv-{name.replace('_', '-')}": str(value) for name, value in report.items() if value is not None}


@router.post("/v1/chat/completions", summary="Chat", dependencies=_authenticated, tags=["OpenAI V1"],
             response_model=Union[llama_cpp.ChatCompletion, str])  # fmt: skip
async def create_chat_completion(request: Request, body: CreateChatCompletionRequest = Body(...)):
    kwargs = body.model_dump(exclude={"n", "logit_bias_type", "user", "min_tokens"})
    return await _serve(request, body, kwargs, "create_chat_completion")


@router.post("/v1/completions", summary="Completion", dependencies=_authenticated, tags=["OpenAI V1"],
             response_model=Union[llama_cpp.CreateCompletionResponse, str])  # fmt: skip
async def create_completion(request: Request, body: CreateCompletionRequest = Body(...)):
    if isinstance(body.prompt, list):
        if len(body.prompt) > 1:
            raise HTTPException(status_code=status.HTTP_400_BAD_REQUEST, detail="one prompt per request")
        body.prompt = body.prompt[0] if body.prompt else ""
    kwargs = body.model_dump(exclude={"n", "best_of", "logit_bias_type", "user", "min_tokens"})
    return await _serve(request, body, kwargs, "create_completion")


@router.get("/kv/stats", summary="KV cache and conversation store", dependencies=_authenticated, tags=["kvp"])
async def kv_stats(request: Request) -> Dict[str, Any]:
    state = _state(request)
    stats = await state.worker.run(state.proxy.llama.server_stats)
    stats["memory_tidy"] = {"runs": state.tidies, "seconds": state.tidy_seconds, "every_seconds": TIDY_SECONDS}
    return stats


@router.get("/kv/cache", summary="The live conversation's cached tokens", dependencies=_authenticated, tags=["kvp"])
async def kv_cache(request: Request) -> Dict[str, Any]:
    state = _state(request)
    return await state.worker.run(state.proxy.llama.cached_tokens)


async def _serve(request: Request, body, kwargs: Dict[str, Any], method: str):
    state = _state(request)
    if kwargs.get("stream", False):
        send, receive = anyio.create_memory_object_stream(10)
        ping = (lambda: bytes()) if state.server_settings.disable_ping_events else None
        return EventSourceResponse(receive, sep="\n", ping_message_factory=ping,
                                   data_sender_callable=functools.partial(_publish, request, send, body, kwargs,
                                                                          method))  # fmt: skip
    async with state.hold() as proxy:
        llama = _prepare(body, proxy, kwargs)
        if await request.is_disconnected():
            raise HTTPException(status_code=status.HTTP_400_BAD_REQUEST, detail="Client closed request")
        result = await state.worker.run(getattr(llama, method), **kwargs)
        report = dict(llama.last_turn)
    return JSONResponse(result, headers=kv_headers(report), background=BackgroundTask(state.tidy))


async def _publish(request: Request, send, body, kwargs: Dict[str, Any], method: str) -> None:
    """Streams one generation as server-sent events, holding the model until the generator is closed."""
    state = _state(request)
    async with state.hold() as proxy, send:
        chunks = None
        try:
            llama = _prepare(body, proxy, kwargs)
            chunks = await state.worker.run(getattr(llama, method), **kwargs)
            held: Optional[Dict[str, Any]] = None  # once a choice finished: the latest chunk, to carry the stats
            while True:
                chunk = await state.worker.run(next, chunks, None)
                if chunk is None:
                    break
                if held is not None:
                    await send.send({"data": json.dumps(held)})
                    held = None
                if _finished(chunk):
                    held = chunk
                    continue
                await send.send({"data": json.dumps(chunk)})
                if await request.is_disconnected():
                    return
                if state.server_settings.interrupt_requests and state.waiting:
                    break
            if held is not None:  # the generator has ended: the turn is recorded
                held["kv_stats"] = dict(llama.last_turn)
                await send.send({"data": json.dumps(held)})
            await send.send({"data": "[DONE]"})
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the client is gone
        except Exception as error:  # the response has started (200): report the error as an event
            _, error_body = error_response(request, error)
            with anyio.move_on_after(1, shield=True):
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await send.send({"data": json.dumps({"error": error_body})})
        finally:
            if chunks is not None:
                await state.worker.run_shielded(chunks.close)
    await state.tidy()


def _prepare(body, proxy: KvpLlamaProxy, kwargs: Dict[str, Any]):
    """llama-cpp-python's request preparation (logit bias, grammar, min_tokens), refusing token ids that are not in
    the vocabulary (llama-cpp-python would index past its logits and drop the bias silently)."""
    llama = llama_app.prepare_request_resources(body, proxy, body.model, kwargs)
    n_vocab = llama.n_vocab()
    for token in (kwargs.get("logit_bias") or {}):
        if not 0 <= int(token) < n_vocab:
            raise HTTPException(status_code=status.HTTP_400_BAD_REQUEST,
                                detail=f"logit_bias: token {token} is not in the vocabulary (0..{n_vocab - 1})")
    return llama


def _finished(chunk: Dict[str, Any]) -> bool:
    return any(choice.get("finish_reason") is not None for choice in chunk.get("choices", []))


def _resolve(settings: Optional[KvpSettings], server_settings: Optional[KvpServerSettings],
             model_settings: Optional[List[KvpModelSettings]]):  # fmt: skip
    if server_settings is None and model_settings is None:
        settings = settings if settings is not None else KvpSettings()
        server_settings = KvpServerSettings(**{name: getattr(settings, name) for name in KvpServerSettings.model_fields})
        model_settings = [KvpModelSettings(**{name: getattr(settings, name) for name in KvpModelSettings.model_fields})]
    if server_settings is None or not model_settings:
        raise ValueError("server_settings and model_settings must be given together")
    return server_settings, model_settings


def create_app(settings: Optional[KvpSettings] = None, server_settings: Optional[KvpServerSettings] = None,
               model_settings: Optional[List[KvpModelSettings]] = None) -> FastAPI:  # fmt: skip
    """The server's app, with its model loaded (``settings``, or ``server_settings`` and one ``model_settings``)."""
    server_settings, model_settings = _resolve(settings, server_settings, model_settings)
    state = ServerState(KvpLlamaProxy(model_settings), server_settings, model_settings[0])

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            state.worker.shutdown()
            state.proxy.free()

    app = FastAPI(middleware=[Middleware(RawContextMiddleware, plugins=(RequestIdPlugin(),))],
                  title="kvp-cpp chat server", version=llama_cpp.__version__, root_path=server_settings.root_path,
                  lifespan=lifespan)  # fmt: skip
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=True, allow_methods=["*"],
                       allow_headers=["*"])  # fmt: skip
    app.state.kvp = state
    app.include_router(router)
    app.include_router(APIRouter(routes=[route for route in llama_app.router.routes
                                         if getattr(route, "path", None) not in _REPLACED_PATHS]))  # fmt: skip
    app.dependency_overrides[llama_app.get_llama_proxy] = _hold_model
    app.dependency_overrides[llama_app.get_server_settings] = _server_settings
    return app
