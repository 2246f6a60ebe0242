"""The Tinker API's HTTP routes (FastAPI), under /api/v1, for the unmodified `tinker` SDK. The protocol, what each
route returns and what is refused: docs/tutorial-your-loop.md, "Reference".

Authentication is the server's (`api.create_app`'s middleware): the SDK sends its key as `X-API-Key`, and the key
of a PlexRL token is `tml-<token>` (the SDK insists on that prefix). A server without tokens (loopback only)
takes the key's rest as the user's name (`tml-ann`: user ann), as it takes `--user` from `plexrl submit`.

Errors: a refused request gets its 4xx with `{"detail": sentence}` and changes nothing; a call that fails later
(on the service) fails its future with `{"error", "category"}`, which the SDK raises as `RequestFailedError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from plexrl.server.tinker import exports, handlers, proto, rest, samplers
from plexrl.server.tinker.decode import Refused
from plexrl.server.tinker.futures import GONE
from plexrl.server.tinker.registry import Registry

log = logging.getLogger(__name__)

PREFIX = "/api/v1"
KEY_PREFIX = "tml-"
MAX_REASON = 64  # characters of a finished session's reason that are kept
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
INLINE_JSON = 64 << 10  # a JSON body up to this size parses on the event loop; a larger one in a thread, budgeted


def parse_json(raw: bytes) -> Any:
    """A JSON body's value. Python's objects take up to ~20x the bytes of a body of empty arrays (`[[],[],...]`),
    so a large body parses within the `DecodeBudget` the protobuf bodies share."""
    return json.loads(raw or b"{}")


def key_of(request: Request) -> str:
    """The token part of the SDK's key (`X-API-Key: tml-<token>`), or "" without one."""
    return request.headers.get("x-api-key", "").removeprefix(KEY_PREFIX)


def _refused(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status, headers={"x-should-retry": "false"})


class DecodeBudget:
    """At most `limit` bytes of request bodies decoding at once (a larger body decodes alone), the others waiting
    their turn in arrival order. The protobuf library builds every message of a body before anything can be
    counted (20-30 bytes of memory a wire byte for a body of empty messages), and Python's JSON parser up to
    ~20 (`parse_json`): this bounds all decodes together at about 30 x `limit`, however many clients send at
    once (protobuf and large JSON bodies share one budget). For the event loop's coroutines (a waiting request
    holds no thread); `peak`: the most bytes held at once."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used, self.peak = limit, 0, 0
        self.waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    @contextlib.asynccontextmanager
    async def hold(self, size: int) -> AsyncIterator[None]:
        size = min(size, self.limit)
        if self.waiting or self.used + size > self.limit:
            turn = asyncio.get_running_loop().create_future()
            self.waiting.append((size, turn))
            try:
                await turn
            except BaseException:  # (cancelled: its place given up, or its bytes given back if granted meanwhile)
                if turn.done() and not turn.cancelled():
                    self._release(size)
                else:
                    if (size, turn) in self.waiting:  # (a cancelled turn that `_grant` met is gone already)
                        self.waiting.remove((size, turn))
                    self._grant()
                raise
        else:
            self.used += size
        self.peak = max(self.peak, self.used)
        try:
            yield
        finally:
            self._release(size)

    def _release(self, size: int) -> None:
        self.used -= size
        self._grant()

    def _grant(self) -> None:
        while self.waiting and self.used + self.waiting[0][0] <= self.limit:
            size, turn = self.waiting.popleft()
            if not turn.done():
                self.used += size
                turn.set_result(None)


def add_tinker_routes(app: FastAPI, registry: Registry, *, open_server: bool) -> None:
    """Serve the Tinker API on `app`. `open_server`: no tokens are configured (loopback only): the user is the
    name in the client's key; otherwise it is the identity the auth middleware put in `request.state.user`
    (None: the administrator)."""
    router = APIRouter(prefix=PREFIX)
    cfg = registry.cfg
    decodes = DecodeBudget(cfg.max_body_bytes)  # (forward_backward bodies: one of the largest size at a time)

    def who(request: Request) -> str | None:
        if not open_server:
            user: str | None = getattr(request.state, "user", None)
            return user
        name = key_of(request)
        if name and not NAME.fullmatch(name):
            raise Refused(401, "without server tokens the key names its user: tml-<name>, [A-Za-z0-9_.-]{1,64}")
        return name

    def owner(request: Request) -> str:
        return who(request) or ""

    async def body_of(request: Request) -> bytes:
        if request.headers.get("content-encoding", "identity") not in ("identity", ""):
            raise Refused(415, "compressed request bodies are not served; the server's client config says so")
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > cfg.max_body_bytes):
            raise Refused(
                413, f"the body is larger than this server's {cfg.max_body_bytes} bytes (tinker.max_body_bytes)"
            )
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cfg.max_body_bytes:
                raise Refused(413, f"the body is larger than this server's {cfg.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def json_of(request: Request) -> dict[str, Any]:
        raw = await body_of(request)
        try:
            if len(raw) <= INLINE_JSON:
                body = parse_json(raw)
            else:  # off the event loop, and at most `max_body_bytes` of bodies parsing at once
                async with decodes.hold(len(raw)):
                    body = await run_in_threadpool(parse_json, raw)
        except ValueError:
            raise Refused(400, "the body is not JSON") from None
        except RecursionError:  # (arrays or objects nested some thousands deep)
            raise Refused(400, "the body's JSON is nested too deep") from None
        if not isinstance(body, dict):
            raise Refused(400, "the body must be a JSON object")
        return body

    async def guarded(call: Any) -> Any:
        try:
            out = await call
        except Refused as exc:
            return _refused(exc.status, exc.message)
        return out

    @router.get("/healthz")
    async def healthz() -> Any:
        return {"status": "ok"}

    @router.get("/get_server_capabilities")
    async def capabilities() -> Any:
        return await run_in_threadpool(handlers.get_server_capabilities, registry)

    @router.post("/client/config")
    async def client_config() -> Any:
        # (the SDK fetches this with a client it never closes: closing the connection here leaves it nothing open)
        return JSONResponse({
            "pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False,
            "proto_compress_fwdbwd": False, "fwdbwd_max_chunk_len": cfg.max_datums,
            "fwdbwd_max_chunk_bytes_count": cfg.max_body_bytes // 2, "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False, "sample_join_sampling_session": False,
        }, headers={"connection": "close"})  # fmt: skip

    @router.post("/client/dynamic_config")
    async def dynamic_config() -> Any:
        return {"refresh_interval_sec": 3600, "sample_cancel_enabled": True}

    @router.post("/telemetry")
    async def telemetry(request: Request) -> Any:
        return {"status": "accepted"}  # (dropped: PlexRL tracks runs in MLflow)

    @router.post("/cancel_future")
    async def cancel_future(request: Request) -> Any:
        async def go() -> Any:  # (a call still queued is taken back; anything else is left as it is)
            rid = (await json_of(request)).get("request_id")
            if isinstance(rid, str):
                await run_in_threadpool(registry.futures.cancel, rid, who(request))
            return Response(status_code=200)

        return await guarded(go())

    async def run(fn: Any, *args: Any) -> Any:
        return await run_in_threadpool(fn, *args)

    @router.post("/create_session")
    async def create_session(request: Request) -> Any:
        async def go() -> Any:
            await json_of(request)
            return await run(registry.create_session, owner(request))

        return await guarded(go())

    @router.post("/session_heartbeat")
    async def heartbeat(request: Request) -> Any:
        async def go() -> Any:
            body = await json_of(request)
            return await run(registry.heartbeat, who(request), body.get("session_id"))

        return await guarded(go())

    @router.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> Any:
        async def go() -> Any:
            body = await json_of(request)
            reason: dict[str, Any] = body["reason"] if isinstance(body.get("reason"), dict) else {}
            kind = str(reason.get("type", "success"))
            kind = kind if len(kind) <= MAX_REASON else kind[:MAX_REASON] + "..."  # (kept: a bounded size)
            why = f"finished by its client ({kind!r})"
            await run(registry.finish, who(request), session_id, why)
            return {}

        return await guarded(go())

    def posting(path: str, fn: Any, creates: bool = False) -> None:
        """A JSON POST route to `fn(registry, user, body)`; `creates`: what it makes belongs to the caller."""

        async def handler(request: Request) -> Any:
            async def go() -> Any:
                body = await json_of(request)
                return await run(fn, registry, owner(request) if creates else who(request), body)

            return await guarded(go())

        router.post(path, operation_id="tinker" + path.replace("/", "_"))(handler)

    posting("/create_model", handlers.create_model, creates=True)
    posting("/optim_step", handlers.optim_step)
    posting("/save_weights", handlers.save_weights)
    posting("/save_weights_for_sampler", handlers.save_for_sampler)
    posting("/save_weights_external", exports.save_external)
    posting("/load_weights", handlers.load_weights, creates=True)
    posting("/create_sampling_session", samplers.create_sampler, creates=True)
    posting("/asample", samplers.asample)
    posting("/unload_model", handlers.unload_model)

    @router.post("/get_info")
    async def get_info(request: Request) -> Any:
        async def go() -> Any:
            body = await json_of(request)
            return await run(handlers.get_info, registry, who(request), body.get("model_id"))

        return await guarded(go())

    @router.post("/forward_backward")
    async def forward_backward(request: Request) -> Any:
        async def go() -> Any:
            raw = await body_of(request)
            if "protobuf" not in request.headers.get("content-type", ""):
                raise Refused(415, "forward_backward takes a protobuf body (the SDK's); JSON is not served")
            try:
                async with decodes.hold(len(raw)):
                    wire = await run(proto.decode_forward_backward, raw, cfg.max_datums)
            except proto.TooLarge as exc:
                raise Refused(413, f"forward_backward body too large: {exc}") from None
            except proto.WireError as exc:
                raise Refused(400, f"malformed forward_backward body: {exc}") from None
            return await run(handlers.forward_backward, registry, who(request), wire)

        return await guarded(go())

    @router.get("/samplers/{sampler_id}")
    async def sampler(sampler_id: str, request: Request) -> Any:
        async def go() -> Any:
            return await run(samplers.get_sampler, registry, who(request), sampler_id)

        return await guarded(go())

    @router.post("/retrieve_future")
    async def retrieve(request: Request) -> Any:
        async def go() -> Any:
            body = await json_of(request)
            rid = body.get("request_id")
            user = who(request)
            peer = (request.client.host, request.client.port) if request.client is not None else None
            fut = await registry.futures.wait(rid, cfg.poll_s, user, peer) if isinstance(rid, str) else None
            if fut is None:  # 410: the SDK sends a sampling call again, and raises RetryableException otherwise
                return _refused(410, f"unknown request {rid!r}: {GONE}")
            if fut.kind is None:  # (the SDK asks again at once: this answer came after `poll_s`)
                state = "paused_capacity" if fut.reason else "active"
                return {"type": "try_again", "request_id": rid, "queue_state": state,
                        "queue_state_reason": fut.reason or None}  # fmt: skip
            if fut.kind == "proto":
                return Response(fut.payload, media_type="application/x-protobuf")
            if fut.kind == "error":
                message, category = fut.payload
                return {"error": message, "category": category}
            return fut.payload

        return await guarded(go())

    rest.add_rest_routes(router, registry, who)  # the RestClient's training runs and checkpoints

    @router.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False)
    async def unserved(rest: str) -> Any:
        return _refused(
            404, f"PlexRL does not serve {PREFIX}/{rest} of the Tinker API (see docs/tutorial-your-loop.md)"
        )

    app.include_router(router)


__all__ = ["KEY_PREFIX", "PREFIX", "DecodeBudget", "add_tinker_routes", "key_of"]
