"""Non-streaming response bodies, encoded in bounded pieces off the event loop.

A whole response encoded in one call (`json.dumps` of `model_dump()`, as
JSONResponse does) holds the GIL for the whole body: a 107 MB completion
(n=128 x 1,500 tokens x 20 logprobs) froze every client, /health included,
for 5 s, and the API process held the outputs, the models, their dict copy
and the JSON text at once (1.24 GiB). Here the handlers build their choices
in the request worker pool and encode them as they go, into fragments: the
small fields of a model in one call, its large lists in slices of
`SLICE_ITEMS` items, so no single call holds the GIL for long (the event
loop's thread takes it back between calls, at least every switch interval).
`JSONFragmentsResponse` then writes the fragments in pieces of about
`WRITE_BYTES`, letting go of each once written: the body exists once.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel
from pydantic_core import to_json
from starlette.responses import Response

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from pagedllm.entrypoints.openai.request_pool import RequestWorkerPool

T = TypeVar("T")

# List items per encoder call: ~256 tokens of 20 logprobs is ~150 KB of
# JSON, well under a millisecond of holding the GIL.
SLICE_ITEMS = 256
# Bytes per write to the socket: big enough to be cheap, small enough that
# the transport never buffers a second copy of a large body.
WRITE_BYTES = 1 << 20

Encoder = Callable[[Any, list[bytes]], None]


async def encode_in_pool(pool: RequestWorkerPool, encode: Callable[..., list[bytes]], *args: Any) -> list[bytes]:
    """`encode(*args, cancelled)` in the pool; when the caller is cancelled
    (the client left), `cancelled` is set so the encoder can stop early
    rather than finish a body nobody will read (see stop_when)."""
    cancelled = threading.Event()
    try:
        return await pool.run(encode, *args, cancelled)
    except asyncio.CancelledError:
        cancelled.set()
        raise


def stop_when(cancelled: threading.Event, items: Iterable[T]) -> Iterator[T]:
    """`items` until `cancelled` is set."""
    for item in items:
        if cancelled.is_set():
            return
        yield item


def encode_list(items: Sequence[Any], out: list[bytes]) -> None:
    """`items` as a JSON array, `SLICE_ITEMS` items per encoder call."""
    out.append(b"[")
    for start in range(0, len(items), SLICE_ITEMS):
        if start:
            out.append(b",")
        # NOTE: inf/nan as null, as pydantic's model_dump_json writes them (never invalid JSON).
        out.append(to_json(items[start:start + SLICE_ITEMS], inf_nan_mode="null")[1:-1])
    out.append(b"]")


def encode_each(items: Iterable[T], out: list[bytes], encode_item: Callable[[T, list[bytes]], None]) -> None:
    """A JSON array of `items`, each encoded by `encode_item` as it comes
    (so a generator's items can be built, encoded and dropped one by one)."""
    out.append(b"[")
    for index, item in enumerate(items):
        if index:
            out.append(b",")
        encode_item(item, out)
    out.append(b"]")


def encode_model(model: BaseModel, out: list[bytes], large: Mapping[str, Encoder] | None = None) -> None:
    """`model` as a JSON object: its fields in one call except those named in
    `large` (when not None), which follow, each written by its encoder (so
    they come last; JSON objects are unordered)."""
    present = {name: encode for name, encode in (large or {}).items() if getattr(model, name) is not None}
    head = model.model_dump_json(exclude=set(present)).encode()
    if not present:
        out.append(head)
        return
    out.append(head[:-1])
    separator = b"," if head != b"{}" else b""
    for name, encode in present.items():
        out.append(separator + json.dumps(name).encode() + b":")
        encode(getattr(model, name), out)
        separator = b","
    out.append(b"}")


class JSONFragmentsResponse(Response):
    """An application/json response whose body is `fragments` (the pieces of
    one JSON document), written in pieces of about WRITE_BYTES, with its
    Content-Length; each fragment is dropped once written."""

    media_type = "application/json"

    def __init__(self, fragments: list[bytes], status_code: int = 200) -> None:
        self.fragments = fragments
        super().__init__(None, status_code, headers={"content-length": str(sum(map(len, fragments)))})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        pending = self.fragments
        self.fragments = []
        pending.reverse()  # pop() from the end is O(1)
        more_body = True
        while more_body:
            piece: list[bytes] = []
            size = 0
            # A fragment of WRITE_BYTES or more goes alone (joining it would copy it).
            while pending and size < WRITE_BYTES and not (piece and len(pending[-1]) >= WRITE_BYTES):
                piece.append(pending.pop())
                size += len(piece[-1])
            more_body = bool(pending)
            await send({"type": "http.response.body", "body": b"".join(piece), "more_body": more_body})


__all__ = ["JSONFragmentsResponse", "encode_each", "encode_in_pool", "encode_list", "encode_model", "stop_when"]
