"""A request's outputs as they come: its previews (`PartialImage`), then its `RequestOutput`.

One shape for both front ends: `AsyncRequestStream` for the HTTP server (server-sent events,
entrypoints/openai/serving_stream.py), `iter_request_outputs` for offline `Omni.generate(...,
stream=True)`. The engine calls a request's preview receiver on the decode worker's thread, always
before it resolves the request's future (decode_worker.py reports a request's previews before its
final image), so the final output is the last item and no preview follows it. Leaving the
iteration early aborts the request (its slot is free for the next step).
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Iterator

from vllm_omni.diffusion.outputs import PartialImage, RequestOutput
from vllm_omni.diffusion.request import OmniDiffusionRequest


class AsyncRequestStream:
    """`await start()` admits the request (raising what `engine.add_request` raises: a bad request
    fails before anything is streamed); then `async for item in stream` yields its previews and
    finally its `RequestOutput` (or raises `RequestFailedError` / `RequestAbortedError`)."""

    def __init__(self, engine, request: OmniDiffusionRequest):
        self.engine = engine
        self.request = request
        self.handle = None
        self._queue: asyncio.Queue[PartialImage] = asyncio.Queue()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def on_partial(partial: PartialImage) -> None:  # the decode worker's thread
            loop.call_soon_threadsafe(self._queue.put_nowait, partial)

        adding = asyncio.ensure_future(asyncio.to_thread(self.engine.add_request, self.request, on_partial))
        try:
            self.handle = await asyncio.shield(adding)
        except asyncio.CancelledError:
            adding.add_done_callback(self._abort_when_added)
            raise

    def _abort_when_added(self, adding: asyncio.Future) -> None:
        if not adding.cancelled() and adding.exception() is None:
            self.engine.abort(adding.result().req_id)

    async def __aiter__(self) -> AsyncIterator[PartialImage | RequestOutput]:
        final = asyncio.wrap_future(self.handle.future)
        try:
            while not final.done():
                getter = asyncio.ensure_future(self._queue.get())
                await asyncio.wait({getter, final}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                else:
                    getter.cancel()
            while not self._queue.empty():  # previews reported just before the final image
                yield self._queue.get_nowait()
            yield final.result()
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort the request unless it has ended (a client that left, a shutdown)."""
        if self.handle is not None and not self.handle.done():
            self.engine.abort(self.handle.req_id)


_DONE = object()


def iter_request_outputs(engine, requests: list[OmniDiffusionRequest]) -> Iterator[tuple[int, object]]:
    """Queue `requests` and yield `(i, item)` as they come, across all of them: request i's previews
    (`PartialImage`), then its final `RequestOutput`, or the exception it failed with. Leaving early
    aborts the ones still running."""
    items: queue.Queue = queue.Queue()
    handles = []
    try:
        for i, request in enumerate(requests):
            handle = engine.add_request(request, lambda partial, i=i: items.put((i, partial)))
            handle.future.add_done_callback(lambda _, i=i: items.put((i, _DONE)))
            handles.append(handle)
        num_left = len(handles)
        while num_left:
            i, item = items.get()
            if item is not _DONE:
                yield i, item
                continue
            num_left -= 1
            exc = handles[i].future.exception()
            yield i, exc if exc is not None else handles[i].future.result()
    finally:
        for handle in handles:
            if not handle.done():
                engine.abort(handle.req_id)
