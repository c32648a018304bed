"""The live view of the KV block pool: GET /dashboard (the page), GET /v1/kv/state (what it shows),
GET /v1/kv/blocks/{block_id} (one block), GET /v1/kv/sequences/{seq_id}/reads (which of a sequence's blocks the
last step read, per layer, under sparse attention).

What it exposes is the cache's structure: block states, block tables, owners as the server's own
request ids, prefix hashes, counters. A block's tokens (ids and text) are the requests' prompts and
outputs: they are shown only where the operator asked for them (ServerConfig.kv_dashboard_content),
and then only to a caller that presents the block's cache salt in the X-Cache-Salt header (none for
an unsalted block), so that the view never hands one tenant's prompts to another.

The page polls the state every STATE_INTERVAL seconds rather than reading a stream of server-sent
events: a browser's EventSource cannot send an Authorization header (the key would travel in the URL,
into logs and history), and every poller is served the newest snapshot until it is STATE_INTERVAL
old, so the engine takes at most 1 / STATE_INTERVAL snapshots a second however many pages watch, and
none when nobody does. A snapshot is one byte a block and the block tables: small enough to send whole
each time, so there is nothing for a stream of changes to save.

/dashboard is served without the API key: it is the same page for everyone and holds no data, and a
browser cannot attach a bearer token to a page it navigates to. The page asks for the key once, keeps
it for the tab's session, and sends it with every read of the state, which needs it.
"""
from __future__ import annotations

import asyncio
import json
import time
from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvserve.engine.kv_state import KVSnapshot, render
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.errors import APIError
from kvserve.server.metrics import ServerMetrics
from kvserve.server.tokenization import ServerTokenizer

STATE_INTERVAL = 0.25        # seconds a snapshot is served for: the page's poll period
PAGE = files("kvserve.server").joinpath("static/dashboard.html")
# the page reaches nothing but this server: no CDN, no font, no image from elsewhere
PAGE_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
            "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class KVStateView:
    """Snapshots of the engine's KV cache, taken between two steps, at most one per `interval`."""

    def __init__(self, server: AsyncEngine, tokenizer: ServerTokenizer, metrics: ServerMetrics, model_name: str,
                 interval: float = STATE_INTERVAL, show_content: bool = False):
        self.server, self.tokenizer, self.metrics = server, tokenizer, metrics
        self.model_name, self.interval, self.show_content = model_name, interval, show_content
        self._body: bytes | None = None
        self._taken = 0.0
        self._pending: asyncio.Future | None = None
        self._block_lock = asyncio.Lock()

    async def state(self) -> bytes:
        """The JSON of the newest snapshot: the one served for less than `interval`, else a new one
        that every caller who asks meanwhile waits for too."""
        if self._body is not None and time.monotonic() - self._taken < self.interval:
            return self._body
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._take())
        # shielded: a poller that goes away must not cancel the snapshot the others wait for
        return await asyncio.shield(self._pending)

    async def _take(self) -> bytes:
        started = time.monotonic()
        try:
            snap = await self.server.query("kv_state")
            body = await asyncio.to_thread(self._encode, snap)
            self._body, self._taken = body, started
            return body
        finally:
            self._pending = None

    def _encode(self, snap: KVSnapshot) -> bytes:
        state = render(snap)
        sample = self.metrics.registry.get_sample_value
        labels = {"model_name": self.model_name}
        state["model"] = self.model_name
        # the server's own counters (what /metrics reports), for tokens/s
        state["server"] = {"prompt_tokens": sample("kvserve:prompt_tokens_total", labels) or 0,
                           "generation_tokens": sample("kvserve:generation_tokens_total", labels) or 0,
                           "num_in_flight": self.server.num_in_flight}
        return json.dumps(state).encode()

    async def block(self, block_id: int, cache_salt: str | None = None) -> dict:
        """One block's owners, reference count and prefix hash; its tokens and their text (decoded here,
        off the event loop) only as kv_state.block_detail allows a caller presenting `cache_salt`. One
        read at a time goes to the engine."""
        stats = self.server.stats()
        total = stats["kv_blocks_total"] if stats is not None else 0
        if not 0 <= block_id < total:
            raise APIError(404, f"block_id: there is no block {block_id}; the pool has {total} blocks "
                                f"(0 to {total - 1})", "block_id")
        async with self._block_lock:
            detail = await self.server.query("kv_block", block_id, self.show_content, cache_salt)
        ids = detail["token_ids"]
        has_text = ids is not None and self.tokenizer.tokenizer is not None
        detail["text"] = await self.tokenizer.decode(ids) if has_text else None
        return detail


    async def reads(self, seq_id: int) -> dict:
        """kv_state.sparse_reads of a sequence; a 404 for one that was not in the last step under sparse
        attention."""
        try:
            return await self.server.query("sparse_reads", seq_id)
        except ValueError as e:
            raise APIError(404, str(e), "seq_id") from None


def add_dashboard_routes(app: FastAPI, view: KVStateView) -> None:
    """GET /dashboard, GET /v1/kv/state, GET /v1/kv/blocks/{block_id} and GET /v1/kv/sequences/{seq_id}/reads on
    `app`."""
    page = PAGE.read_bytes()

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return Response(page, media_type="text/html; charset=utf-8",
                        headers={"content-security-policy": PAGE_CSP, "cache-control": "no-store"})

    @app.get("/v1/kv/state")
    async def kv_state() -> Response:
        return Response(await view.state(), media_type="application/json", headers={"cache-control": "no-store"})

    @app.get("/v1/kv/blocks/{block_id}")
    async def kv_block(block_id: int, request: Request) -> Response:
        detail = await view.block(block_id, request.headers.get("x-cache-salt"))
        return Response(json.dumps(detail), media_type="application/json", headers={"cache-control": "no-store"})

    @app.get("/v1/kv/sequences/{seq_id}/reads")
    async def kv_reads(seq_id: int) -> Response:
        return Response(json.dumps(await view.reads(seq_id)), media_type="application/json",
                        headers={"cache-control": "no-store"})
