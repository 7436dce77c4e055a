"""AsyncLLMEngine: the engine loop runs in its own thread; each request streams its outputs through its own
asyncio queue. The engine is touched only from its thread: requests and aborts reach it through an inbox."""
from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
from collections.abc import AsyncIterator, Callable

from tierllm.engine.llm_engine import LLMEngine
from tierllm.engine.outputs import RequestOutput
from tierllm.sampling import SamplingParams

logger = logging.getLogger("tierllm")

# The engine thread needs the GIL back the moment the GPU finishes a step (sampling, scheduling and the next
# launch happen in Python while the GPU idles), but while the event loop streams chunks to clients it holds the
# GIL and only yields it every sys.getswitchinterval() (5 ms by default: a sixth of a 30 ms step). A shorter
# interval bounds that wait.
_GIL_SWITCH_INTERVAL_S = 0.0005


class QueueFullError(RuntimeError):
    """More requests are waiting than the server's --max-queue allows."""


class _Stream:
    """The newest output of one request. Outputs are cumulative, so a consumer that falls behind (a client that
    stops reading) skips to the newest instead of piling up one snapshot per step."""

    def __init__(self):
        self.latest: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item) -> None:
        if not isinstance(self.latest, BaseException):      # an error is never overwritten
            self.latest = item
        self.ready.set()

    async def get(self):
        await self.ready.wait()
        self.ready.clear()
        item, self.latest = self.latest, None
        return item


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_queue: int, on_step: Callable[[LLMEngine, list], None] | None = None):
        self.engine = engine
        self.max_unfinished = engine.config.scheduler.max_num_seqs + max_queue   # running + waiting
        self.on_step = on_step                        # called in the engine thread after each step (metrics)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, _Stream] = {}        # request id -> its newest output (event-loop side)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._saved_switch_interval: float | None = None
        self._pending: list[tuple[str, object]] = []  # the last step's outputs, delivered once the next is launched

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._saved_switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._saved_switch_interval, _GIL_SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, name="tierllm-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the engine thread, then release the engine (workers, offload stores): the process may end by a
        re-raised signal, which runs no atexit hook."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._saved_switch_interval is not None:
            sys.setswitchinterval(self._saved_switch_interval)
            self._saved_switch_interval = None
        self.engine.close()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yields the request's output after every step that changed it; aborts it if the consumer leaves."""
        self.engine.validate_request(prompt_token_ids, params)       # reads config only: safe from this thread
        if self.num_unfinished >= self.max_unfinished:
            raise QueueFullError(f"the server has {self.num_unfinished} requests in flight (limit "
                                 f"{self.max_unfinished}); retry later")
        stream = _Stream()
        self._streams[request_id] = stream
        self._send(("add", request_id, prompt_token_ids, params))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:                                        # client gone or error: free its blocks
                self._send(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def stop_choice(self, request_id: str, index: int) -> None:
        """One of the request's n outputs is done (a stop string): stop computing it."""
        self._send(("stop_choice", request_id, index))

    def _send(self, message) -> None:
        self._inbox.put(message)
        self._wake.set()

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put(item)

    def _deliver_threadsafe(self, items: list[tuple[str, object]]) -> None:
        """One hop to the event loop per engine step (not per request): less GIL ping-pong under load."""
        if items:
            self._loop.call_soon_threadsafe(self._deliver, items)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message[0] == "add":
                _, request_id, prompt, params = message
                try:
                    self.engine.add_request(request_id, prompt, params)
                except ValueError as exc:
                    self._deliver_threadsafe([(request_id, exc)])
            elif message[0] == "stop_choice":
                self.engine.stop_choice(message[1], message[2])
            else:
                self.engine.abort(message[1])

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._loop_once()
            except Exception as exc:                               # never leave a client hanging
                logger.exception("tierllm: engine loop failed; aborting the requests in flight")
                self._deliver_pending()                            # requests that finished before the failure
                failed = list(self.engine.groups)
                for request_id in failed:
                    self.engine.abort(request_id)
                self._deliver_threadsafe([(r, RuntimeError(f"engine failure: {exc}")) for r in failed])

    def _loop_once(self) -> None:
        self._drain_inbox()
        if not self.engine.has_unfinished_requests():
            if self.on_step is not None:                            # aborts change the state too
                self.on_step(self.engine, [])
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            return
        outputs = self.engine.step(on_launched=self._deliver_pending)
        self._deliver_pending()                    # the step launched nothing: what waited goes now
        self._pending = [(output.request_id, output) for output in outputs]
        if not self.engine.has_unfinished_requests():
            self._deliver_pending()                # no next step to wait for
        if self.on_step is not None:
            self.on_step(self.engine, outputs)

    def _deliver_pending(self) -> None:
        """Hand the previous step's outputs to the event loop. Called once the next step's forward pass is queued
        on the device: the event loop then streams them while this thread waits for the device, instead of
        competing for the GIL with the Python work (scheduling, kernel launches) that keeps the device busy."""
        pending, self._pending = self._pending, []
        self._deliver_threadsafe(pending)
