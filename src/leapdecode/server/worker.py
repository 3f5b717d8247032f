"""The engine in its own thread: requests come in through a queue, tokens go out to each
request's asyncio queue. The HTTP side never touches the engine directly.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass

from ..engine import Engine
from ..metrics import EngineMetrics
from ..sequence import Sequence

log = logging.getLogger("leapdecode.server")


class QueueFull(Exception):
    """More requests are waiting than --max-queue allows."""


@dataclass
class Event:
    tokens: list[int]
    finished: bool
    error: str | None = None


class _Sink:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    def put(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


class EngineWorker:
    def __init__(self, engine: Engine, metrics: EngineMetrics, max_queue: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.sinks: dict[int, _Sink] = {}
        self.pending = 0  # submitted, not yet taken from the inbox
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, name="leapdecode-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=10)

    # ------------------------------------------------------------ HTTP side
    def submit(self, seq: Sequence) -> asyncio.Queue[Event]:
        """Queue a request; its events arrive on the returned queue. Raises QueueFull."""
        with self.lock:
            if self.pending + len(self.engine.waiting) >= self.max_queue:
                self.metrics.on_rejected("rejected")
                raise QueueFull
            self.pending += 1
        sink = _Sink(asyncio.get_running_loop())
        self.inbox.put(("add", seq, sink))
        self.wake.set()
        return sink.queue

    def abort(self, seq_id: int) -> None:
        self.inbox.put(("abort", seq_id, None))
        self.wake.set()

    # ---------------------------------------------------------- engine side
    def _drain(self) -> None:
        while True:
            try:
                what, item, sink = self.inbox.get_nowait()
            except queue.Empty:
                return
            if what == "add":
                with self.lock:
                    self.pending -= 1
                self.sinks[item.id] = sink
                try:
                    self.engine.add_request(item)
                except Exception as e:  # noqa: BLE001 - refuse this one request, keep serving
                    self._finish(item, "error", str(e))
            else:
                seq = self.engine.abort(item)
                if seq is not None:
                    self._finish(seq, "abort")

    def _finish(self, seq: Sequence, status: str, error: str | None = None) -> None:
        sink = self.sinks.pop(seq.id, None)
        self.metrics.on_finish(seq, status)
        if sink is not None:
            sink.put(Event([], True, error))

    def _loop(self) -> None:
        while not self.stopped:
            self._drain()
            if not self.engine.has_unfinished():
                self.metrics.running.set(0)
                self.metrics.waiting.set(0)
                self.wake.wait(timeout=0.5)
                self.wake.clear()
                continue
            try:
                out = self.engine.step()
            except Exception as e:  # noqa: BLE001 - keep serving; fail what was running
                log.exception("engine step failed")
                for seq in list(self.engine.running) + list(self.engine.waiting):
                    self.engine.abort(seq.id)
                    self._finish(seq, "error", f"internal error: {type(e).__name__}: {e}")
                continue
            for seq, toks in out:
                sink = self.sinks.get(seq.id)
                if sink is None:
                    continue
                if seq.finished:
                    self.sinks.pop(seq.id)
                    self.metrics.on_finish(seq, seq.finish_reason or "length")
                sink.put(Event(toks, seq.finished))
