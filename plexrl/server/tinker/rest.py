"""The RestClient's training-run and checkpoint routes of the Tinker API (`tinker.RestClient`): list and get
training runs, list checkpoints (of a run, or all of the user's), delete, publish / unpublish, set a TTL, weights
info, and the signed download URLs of external weights with the route that serves them. A training run is a model
whose files the server keeps (`<root>/<job>/owner.json`, see `records.py`): it outlives its session, so a run is
listed after its client ended or the server restarted.

Who sees what: a user sees only their own runs and checkpoints; another user's get the same 404 as one that
does not exist (the administrator, user None, sees all). Checkpoint ids are the SDK's: `weights/<name>` (a
training state, `save_state`), `sampler_weights/<name>` (`save_weights_for_sampler`) and
`external_weights/<name>` (`save_weights_external`: a PEFT adapter or a Hugging Face model directory, possibly
age-encrypted; `exports.py`).

What a checkpoint carries besides its file (`<root>/<job>/meta.json`): `public` (publish / unpublish; no other
user can read it either way: PlexRL has no sharing) and `expires_at` (a TTL). An expired checkpoint is deleted
the next time anything lists or reads it (no background sweep). A sampler checkpoint that a live sampling
client reads is not deleted (409).

Downloads (`get_external_weights_urls`, and so the cookbook's `weights.download`): one URL per file of an
export, signed for `exports.URL_TTL_S` (`exports.Signer`), under `GET <prefix>/external_weights/download/...`.
That route takes no key (the server's authentication lets exactly that path through: the SDK's download sends no
header); a URL altered in any part, another file's signature, an expired one or one of a deleted export gets 403,
and a name that is not a plain file name of the export 404. The URLs name the host the client asked through
(`request.base_url`): behind a proxy, make it pass the original Host.

Not served (404 from the catch-all route): sessions' listing, copies, billing.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from plexrl.server.tinker.decode import Refused
from plexrl.server.tinker.exports import FILE, KIND, URL_TTL_S, Signer, export_dir, export_files, export_size
from plexrl.server.tinker.records import (
    KINDS,
    NAME,
    checked_name,
    file_of,
    job_of,
    parse_path,
    read_owner,
    tinker_path,
)
from plexrl.server.tinker.registry import Registry

MODEL_ID = re.compile(r"s[0-9a-f]{16}:(train|sample):\d{1,9}")
TYPES = {"weights": "training", "sampler_weights": "sampler", KIND: "external"}
MAX_LIMIT = 1000
MAX_TTL_S = 10 * 365 * 86400
MAX_BODY = 1 << 16  # a ttl or weights_info request is a few bytes
DOWNLOADS = "/external_weights/download"  # (under the API's prefix) the signed URLs' route; api.py lets it in
CHUNK = 1 << 20


def signed_download(prefix: str, path: str) -> bool:
    """Whether a request's `path` is the download route's under the API's `prefix`: the one path the server's
    authentication lets in without a key (`api.create_app`), as its route checks the URL's signature."""
    head = prefix + DOWNLOADS + "/"
    parts = path[len(head) :].split("/") if path.startswith(head) else []
    return len(parts) == 3 and all(p and p not in (".", "..") for p in parts)


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat()


class Runs:
    """The checks and the files behind the routes (`add_rest_routes`); every method takes the caller (`user`,
    None: the administrator) and raises `Refused`."""

    def __init__(self, registry: Registry, clock: Any = None) -> None:
        self.reg = registry
        self.now = clock or (lambda: dt.datetime.now(dt.UTC).timestamp())
        self.signer = Signer(registry.root, self.now)

    # -- ownership ------------------------------------------------------------------------------------
    def owner(self, user: str | None, run_id: Any) -> dict[str, Any]:
        """The run's owner facts; 404 for another user's run or none (the same answer)."""
        facts = read_owner(self.reg.root, run_id) if isinstance(run_id, str) and MODEL_ID.fullmatch(run_id) else None
        if facts is None or (user is not None and facts.get("user") != user):
            raise Refused(404, f"no training run {run_id!r}")
        return facts

    def checkpoint(self, user: str | None, run_id: Any, kind: str, name: str) -> Path:
        """The file of one of the user's checkpoints, or the folder of an export (404 otherwise; an expired one is
        deleted first)."""
        self.owner(user, run_id)
        if kind not in TYPES:
            raise Refused(404, f"no checkpoint {kind}/{name} of {run_id}")
        checked_name(name, "the checkpoint name")
        self._expire(run_id)
        if kind == KIND:
            found = export_dir(self.reg.root, run_id, name)
            if not found.is_dir():
                raise Refused(404, f"no checkpoint {kind}/{name} of {run_id}")
            return found
        found = file_of(self.reg.root, run_id, kind, name)
        if not found.is_file():
            raise Refused(404, f"no checkpoint {kind}/{name} of {run_id}")
        return found

    # -- reading --------------------------------------------------------------------------------------
    def runs(self, user: str | None, limit: Any, offset: Any) -> dict[str, Any]:
        limit, offset = _page(limit, offset)
        ids = []
        for folder in sorted(self.reg.root.iterdir()) if self.reg.root.is_dir() else []:
            facts = read_owner(self.reg.root, folder.name.replace("-", ":"))
            if facts is not None and (user is None or facts.get("user") == user):
                ids.append(str(facts["model_id"]))
        page = [self.run(user, i) for i in ids[offset : offset + limit]]
        return {"training_runs": page, "cursor": {"offset": offset, "limit": limit, "total_count": len(ids)}}

    def run(self, user: str | None, run_id: Any) -> dict[str, Any]:
        facts = self.owner(user, run_id)
        listed = self.checkpoints(user, run_id)["checkpoints"]
        last = {t: max((c for c in listed if c["checkpoint_type"] == t), key=lambda c: c["time"], default=None)
                for t in ("training", "sampler")}  # fmt: skip
        folder = self.reg.root / job_of(run_id)
        seen = max([folder.stat().st_mtime, *(Path(c.pop("_file")).stat().st_mtime for c in listed)])
        with self.reg.lock:
            live = self.reg.models.get(run_id)
            if live is not None and live.status != "ended":
                seen = max(seen, self.now())
        return {
            "training_run_id": run_id, "base_model": facts.get("base_model", ""), "model_owner": facts.get("user", ""),
            "is_lora": facts.get("lora_rank") is not None, "lora_rank": facts.get("lora_rank"),
            "last_request_time": _when(seen), "last_checkpoint": last["training"],
            "last_sampler_checkpoint": last["sampler"], "corrupted": False, "user_metadata": facts.get("user_metadata"),
        }  # fmt: skip

    def checkpoints(self, user: str | None, run_id: Any) -> dict[str, Any]:
        self.owner(user, run_id)
        self._expire(run_id)
        meta = self._meta(run_id)
        out = []
        for kind, (folder, suffix) in KINDS.items():
            for f in sorted((self.reg.root / job_of(run_id) / folder).glob(f"*{suffix}")):
                name = f.name[: -len(suffix)]
                info = meta.get(f"{kind}/{name}", {})
                stat = f.stat()
                out.append({
                    "checkpoint_id": f"{kind}/{name}", "checkpoint_type": TYPES[kind], "time": _when(stat.st_mtime),
                    "tinker_path": tinker_path(run_id, kind, name), "size_bytes": stat.st_size,
                    "public": bool(info.get("public", False)), "expires_at": info.get("expires_at"), "_file": str(f),
                    "user_metadata": info.get("user_metadata"),
                })  # fmt: skip
        exports = self.reg.root / job_of(run_id) / KIND
        for export in sorted(exports.iterdir()) if exports.is_dir() else ():
            if not NAME.fullmatch(export.name) or not export.is_dir():  # (a hidden staging folder: not yet one)
                continue
            info = meta.get(f"{KIND}/{export.name}", {})
            out.append({
                "checkpoint_id": f"{KIND}/{export.name}", "checkpoint_type": "external",
                "time": _when(export.stat().st_mtime), "tinker_path": tinker_path(run_id, KIND, export.name),
                "size_bytes": export_size(export), "public": bool(info.get("public", False)),
                "expires_at": info.get("expires_at"), "_file": str(export), "user_metadata": info.get("user_metadata"),
            })  # fmt: skip
        return {"checkpoints": out, "cursor": None}

    def user_checkpoints(self, user: str | None, limit: Any, offset: Any) -> dict[str, Any]:
        limit, offset = _page(limit, offset)
        every = []
        for run in self.runs(user, MAX_LIMIT, 0)["training_runs"]:
            every += self.checkpoints(user, run["training_run_id"])["checkpoints"]
        every.sort(key=lambda c: c["time"], reverse=True)
        for c in every:
            c.pop("_file", None)
        page = every[offset : offset + limit]
        return {"checkpoints": page, "cursor": {"offset": offset, "limit": limit, "total_count": len(every)}}

    def weights_info(self, user: str | None, path: Any) -> dict[str, Any]:
        run_id, kind, name = _parsed(path)
        self.checkpoint(user, run_id, kind, name)
        facts = self.owner(user, run_id)
        targets = set(facts.get("targets") or ())
        lora = facts.get("lora_rank") is not None
        return {
            "base_model": facts.get("base_model", ""), "is_lora": lora, "lora_rank": facts.get("lora_rank"),
            "train_attn": bool(targets & {"q_proj", "k_proj", "v_proj", "o_proj"}) if lora else None,
            "train_mlp": bool(targets & {"gate_proj", "up_proj", "down_proj"}) if lora else None,
            "train_unembed": "lm_head" in targets if lora else None,
        }  # fmt: skip

    def urls(self, user: str | None, run_id: Any, name: str, base: str) -> dict[str, Any]:
        """`get_external_weights_urls`: a signed URL per file of the user's export, all expiring together
        (`URL_TTL_S` from now); `base`: the API's root URL as the client reached it."""
        folder = self.checkpoint(user, run_id, KIND, name)
        export_id = str(self._meta(run_id).get(f"{KIND}/{name}", {}).get("export_id", ""))
        expires = int(self.now()) + URL_TTL_S
        prefix = f"{base}{DOWNLOADS}/{run_id}/{name}/"
        urls = {f: prefix + f + "?" + self.signer.query(run_id, name, export_id, f, expires)
                for f in export_files(folder)}  # fmt: skip
        return {"urls": urls, "expires": _when(expires)}

    def download(self, run_id: str, name: str, file: str, expires: Any, signature: Any) -> tuple[IO[bytes], int]:
        """The open file a signed URL names, and its size. No caller: the signature is checked first (403), then
        the names are plain names of an export's file (404)."""
        if not MODEL_ID.fullmatch(run_id) or not NAME.fullmatch(name) or not FILE.fullmatch(file):
            raise Refused(404, "a download URL names <model id>/<export name>/<file name>; these are not such names")
        export_id = str(self._meta(run_id).get(f"{KIND}/{name}", {}).get("export_id", ""))
        self.signer.check(run_id, name, export_id, file, expires, signature)
        self._expire(run_id)
        folder = export_dir(self.reg.root, run_id, name)
        if file not in export_files(folder):
            raise Refused(404, f"external weights {name} of {run_id} have no file {file!r}")
        handle = (folder / file).open("rb")
        return handle, os.fstat(handle.fileno()).st_size

    # -- changing -------------------------------------------------------------------------------------
    def delete(self, user: str | None, run_id: Any, kind: str, name: str) -> None:
        found = self.checkpoint(user, run_id, kind, name)
        with self.reg.lock:
            readers = [s.sampler_id for s in self.reg.samplers.values() if s.weights == found and not s.broken]
            if readers:
                raise Refused(409, f"checkpoint {kind}/{name} is read by the live sampling client {readers[0]}; "
                                   "end its session first")  # fmt: skip
            self._remove(run_id, kind, name)
            self._set(run_id, f"{kind}/{name}", None)

    def publish(self, user: str | None, run_id: Any, kind: str, name: str, public: bool) -> None:
        self.checkpoint(user, run_id, kind, name)
        with self.reg.lock:
            self._set(run_id, f"{kind}/{name}", {"public": public})

    def ttl(self, user: str | None, run_id: Any, kind: str, name: str, seconds: Any) -> None:
        self.checkpoint(user, run_id, kind, name)
        if seconds is not None and (not isinstance(seconds, int) or isinstance(seconds, bool)
                                    or not 1 <= seconds <= MAX_TTL_S):  # fmt: skip
            raise Refused(400, f"ttl_seconds must be 1..{MAX_TTL_S} (or null: no expiry)")
        expires = None if seconds is None else _when(self.now() + seconds)
        with self.reg.lock:
            self._set(run_id, f"{kind}/{name}", {"expires_at": expires})

    # -- metadata (`<root>/<job>/meta.json`) ----------------------------------------------------------
    def _meta(self, run_id: str) -> dict[str, dict[str, Any]]:
        try:
            data: dict[str, dict[str, Any]] = json.loads((self.reg.root / job_of(run_id) / "meta.json").read_text())
            return data
        except (OSError, ValueError):
            return {}

    def _set(self, run_id: str, checkpoint: str, update: dict[str, Any] | None) -> None:
        meta = self._meta(run_id)
        if update is None:
            meta.pop(checkpoint, None)
        else:
            meta[checkpoint] = {**meta.get(checkpoint, {}), **update}
        tmp = self.reg.root / job_of(run_id) / ".meta.json.tmp"
        tmp.write_text(json.dumps(meta))
        tmp.replace(tmp.with_name("meta.json"))

    def _expire(self, run_id: str) -> None:
        now = _when(self.now())
        for checkpoint, info in list(self._meta(run_id).items()):
            if info.get("expires_at") and info["expires_at"] <= now:
                kind, name = checkpoint.split("/", 1)
                with self.reg.lock:
                    self._remove(run_id, kind, name)
                    self._set(run_id, checkpoint, None)

    def _remove(self, run_id: str, kind: str, name: str) -> None:
        """A checkpoint's file, or an export's folder, removed (lock held)."""
        if kind == KIND:
            shutil.rmtree(export_dir(self.reg.root, run_id, name), ignore_errors=True)
        elif kind in KINDS:
            file_of(self.reg.root, run_id, kind, name).unlink(missing_ok=True)


def _page(limit: Any, offset: Any) -> tuple[int, int]:
    try:
        lim, off = int(limit), int(offset)
    except (TypeError, ValueError):
        raise Refused(400, "limit and offset must be integers") from None
    if not 1 <= lim <= MAX_LIMIT or off < 0:
        raise Refused(400, f"limit must be 1..{MAX_LIMIT} and offset >= 0")
    return lim, off


def _parsed(path: Any) -> tuple[str, str, str]:
    """(model id, kind, name) of a checkpoint's `tinker://` path, an export's included."""
    parts = path[len("tinker://") :].split("/") if isinstance(path, str) and path.startswith("tinker://") else []
    if len(parts) == 3 and parts[1] == KIND and MODEL_ID.fullmatch(parts[0]):
        return parts[0], KIND, checked_name(parts[2], "the checkpoint name")
    try:
        return parse_path(path)
    except Refused as exc:
        raise Refused(404 if exc.status == 404 else 400, exc.message) from None


def add_rest_routes(router: APIRouter, registry: Registry, who: Any) -> None:
    """Add the routes to the Tinker API's `router` (before its catch-all); `who(request)`: the caller."""
    runs = Runs(registry)

    async def answer(fn: Any, request: Request, *args: Any, read: str | None = None) -> Any:
        """`fn(caller, *args[, the body's field `read`])` in a thread; a refusal as its 4xx."""
        try:
            extra = [(await body(request)).get(read)] if read is not None else []
            out = await run_in_threadpool(fn, who(request), *args, *extra)
        except Refused as exc:
            return JSONResponse({"detail": exc.message}, status_code=exc.status, headers={"x-should-retry": "false"})
        if out is None:
            return Response(status_code=204)
        if isinstance(out, dict) and "checkpoints" in out:
            for c in out["checkpoints"]:
                c.pop("_file", None)
        return out

    async def body(request: Request) -> dict[str, Any]:
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY:
                raise Refused(413, f"the body is larger than {MAX_BODY} bytes")
        try:
            data = json.loads(raw or b"{}")
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise Refused(400, "the body must be a JSON object")
        return data

    @router.get("/training_runs")
    async def list_runs(request: Request, limit: int = 20, offset: int = 0) -> Any:
        return await answer(runs.runs, request, limit, offset)

    @router.get("/training_runs/{run_id}")
    async def get_run(run_id: str, request: Request) -> Any:
        return await answer(runs.run, request, run_id)

    @router.get("/training_runs/{run_id}/checkpoints")
    async def list_checkpoints(run_id: str, request: Request) -> Any:
        return await answer(runs.checkpoints, request, run_id)

    @router.get("/checkpoints")
    async def user_checkpoints(request: Request, limit: int = 100, offset: int = 0) -> Any:
        return await answer(runs.user_checkpoints, request, limit, offset)

    @router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}")
    async def delete(run_id: str, kind: str, name: str, request: Request) -> Any:
        return await answer(runs.delete, request, run_id, kind, name)

    @router.post("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
    async def publish(run_id: str, kind: str, name: str, request: Request) -> Any:
        return await answer(runs.publish, request, run_id, kind, name, True)

    @router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
    async def unpublish(run_id: str, kind: str, name: str, request: Request) -> Any:
        return await answer(runs.publish, request, run_id, kind, name, False)

    @router.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
    async def ttl(run_id: str, kind: str, name: str, request: Request) -> Any:
        return await answer(runs.ttl, request, run_id, kind, name, read="ttl_seconds")

    @router.post("/weights_info")
    async def weights_info(request: Request) -> Any:
        return await answer(runs.weights_info, request, read="tinker_path")

    @router.get(f"/training_runs/{{run_id}}/checkpoints/{KIND}/{{name}}/external_weights_urls")
    async def external_urls(run_id: str, name: str, request: Request) -> Any:
        return await answer(runs.urls, request, run_id, name, str(request.base_url).rstrip("/") + router.prefix)

    @router.get(DOWNLOADS + "/{run_id}/{name}/{file}")
    async def download(run_id: str, name: str, file: str, request: Request) -> Any:
        query = request.query_params
        try:
            handle, size = await run_in_threadpool(
                runs.download, run_id, name, file, query.get("expires"), query.get("signature")
            )
        except Refused as exc:
            return JSONResponse({"detail": exc.message}, status_code=exc.status, headers={"x-should-retry": "false"})
        return StreamingResponse(_chunks(handle), media_type="application/octet-stream",
                                 headers={"content-length": str(size)})  # fmt: skip


def _chunks(handle: IO[bytes]) -> Iterator[bytes]:
    """A file's bytes in `CHUNK`s (Starlette reads a plain iterator in its thread pool), closed at the end."""
    with handle:
        while block := handle.read(CHUNK):
            yield block


__all__ = ["DOWNLOADS", "Runs", "add_rest_routes", "signed_download"]
