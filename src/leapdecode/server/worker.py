"""The engine in a process of its own, as vLLM's engine core: the HTTP process sends requests
and aborts down one pipe; the engine process steps and sends each step's new tokens back up
another, where a reader thread hands them to the event loop, which updates each request and
puts an event on its queue. The two processes share no GIL: the engine's Python (scheduling,
proposals, bookkeeping) no longer waits for the HTTP loop's, nor the loop for the engine's.
With one process they did: at 16 streams `auto`'s plan took 5.5 ms a step in the server
against 1.5-2 ms alone, and auto fell below the best fixed k there (docs/bench/serve-auto-c16).

Messages down (HTTP -> engine): ("add", wire), ("abort", id), ("rejected",),
("metrics", ticket), ("stop",). Up (engine -> HTTP): ("ready", info) or ("failed", message)
once at start-up, then ("step", events, running, waiting, admitted) after every step and
drain, and ("metrics", ticket, text).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import multiprocessing as mp
import queue
import signal
import threading
from dataclasses import dataclass
from multiprocessing.connection import wait

from ..errors import LeapDecodeError
from ..sequence import Sequence

log = logging.getLogger("leapdecode.server")

# Python's cyclic garbage collector scans every tracked object it holds at a full collection,
# and suffix decoding's per-request tries (used by `suffix` and `auto`) are thousands of
# small objects per request: at the default thresholds the collections cost `auto` several
# percent of its wall time against n-grams, which hold no such objects (C = 16 engine-level
# closed loop, auto / ngram k=4: 255 / 285 tokens/s by default, 270 / 267 with these
# thresholds). The models and start-up objects are frozen out of the scans altogether.
GC_THRESHOLDS = (50_000, 20, 100)


class QueueFull(Exception):
    """More requests are waiting than --max-queue allows."""


class EngineGone(Exception):
    """The engine process has exited; nothing more can be served."""


@dataclass
class Event:
    tokens: list[int]
    finished: bool
    error: str | None = None


@contextlib.contextmanager
def _sigint_blocked():
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# ---------------------------------------------------------------- engine process
def engine_main(options: dict, inbox, outbox) -> None:
    """The engine process: load the models (options["load"]: LeapDecoder.from_pretrained's
    keywords), check the server's default speculation (options["spec"]), profile auto's
    costs, then step until told to stop or the HTTP process goes away."""
    from ..api import LeapDecoder
    from ..metrics import EngineMetrics

    # Ctrl-C (and a service manager's SIGTERM) may reach the whole process group: the HTTP
    # process finishes what is in flight, then tells this one to stop (or its pipe closes)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # blocked while it started (EngineClient)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        dec = LeapDecoder.from_pretrained(**options["load"])
        spec = options["spec"]
        dec.engine.check(spec)  # a default the engine cannot run fails now, not per request
        engine = dec.engine
        metrics = EngineMetrics()
        engine.metrics = metrics
        engine.allocate()
        if spec.method == "auto":
            engine.planner.ensure_cost_model()  # profile the step costs before any request
    except LeapDecodeError as e:
        result = ("failed", str(e))
    except Exception as e:  # noqa: BLE001 - said in one line by the HTTP process
        result = ("failed", f"internal error while loading: {type(e).__name__}: {e}")
    else:
        result = (
            "ready",
            {
                "capabilities": engine.capabilities(),
                "eos_token_ids": sorted(dec.eos_token_ids),
                "vocab_size": dec.target.vocab_size,
                "max_context": dec.target.max_context,
            },
        )
    try:
        outbox.send(result)
    except OSError:  # the HTTP process is gone already
        return
    if result[0] == "failed":
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    _Core(dec, metrics, inbox, outbox).run()


class _Core:
    def __init__(self, dec, metrics, inbox, outbox) -> None:
        self.dec = dec
        self.engine = dec.engine
        self.metrics = metrics
        self.inbox = inbox
        self.outbox = outbox
        self.admitted = 0  # "add" messages taken from the inbox
        self.events: list[tuple] = []  # (id, tokens, finished, finish_reason, stats, error)

    def _finish(self, seq: Sequence, status: str, error: str | None = None) -> None:
        self.metrics.on_finish(seq, status)
        self.events.append((seq.id, [], True, status, seq.stats, error))

    def _drain(self) -> bool:
        """Take every waiting message; False once told to stop (or the HTTP side is gone)."""
        try:
            while self.inbox.poll(0):
                message = self.inbox.recv()
                if message[0] == "stop":
                    return False
                try:
                    self._take(*message)
                except Exception:  # noqa: BLE001 - one bad message must not end the engine
                    log.exception("engine: message %r failed", message[0])
        except (EOFError, OSError):
            return False
        return True

    def _take(self, what: str, *rest) -> None:
        """One message from the HTTP process (see the module notes)."""
        if what == "add":
            self.admitted += 1
            seq = Sequence.from_wire(rest[0], self.dec.decode)
            try:
                self.engine.add_request(seq)
            except Exception as e:  # noqa: BLE001 - refuse this one request, keep serving
                self._finish(seq, "error", str(e))
        elif what == "abort":
            seq = self.engine.abort(rest[0])
            if seq is not None:
                self._finish(seq, "abort")
        elif what == "rejected":
            self.metrics.on_rejected("rejected")
        elif what == "metrics":
            self.outbox.send(("metrics", rest[0], self.metrics.render()))

    def _send(self) -> None:
        self.outbox.send(
            ("step", self.events, len(self.engine.running), len(self.engine.waiting), self.admitted)
        )
        self.events = []

    def run(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_unfinished():
                self.metrics.running.set(0)
                self.metrics.waiting.set(0)
                try:
                    self.inbox.poll(None)  # idle: sleep until a message comes
                except (EOFError, OSError):
                    return
            if not self._drain():
                return
            if engine.has_unfinished():
                try:
                    for seq, toks in engine.step():
                        if seq.finished:
                            self.metrics.on_finish(seq, seq.finish_reason or "length")
                        self.events.append(
                            (
                                seq.id,
                                toks,
                                seq.finished,
                                seq.finish_reason,
                                seq.stats if seq.finished else None,
                                None,
                            )
                        )
                except Exception as e:  # noqa: BLE001 - keep serving; fail what was running
                    log.exception("engine step failed")
                    for seq in list(engine.running) + list(engine.waiting):
                        engine.abort(seq.id)
                        self._finish(seq, "error", f"internal error: {type(e).__name__}: {e}")
            try:
                self._send()
            except (BrokenPipeError, OSError):
                return


# ------------------------------------------------------------------ HTTP process
class EngineClient:
    """The HTTP side's handle on the engine process. submit, abort and metrics_text run on
    the event loop; a writer thread sends what they queue, and a reader thread only receives
    and hands each message to the loop, where requests are updated."""

    def __init__(self, options: dict, max_queue: int) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: safe with CUDA and threads
        down_recv, self.down = ctx.Pipe(duplex=False)
        self.up, up_send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=engine_main,
            args=(options, down_recv, up_send),
            name="leapdecode-engine",
            daemon=True,
        )
        # started with Ctrl-C blocked, a mask the child inherits until engine_main ignores
        # Ctrl-C: one pressed meanwhile stops this process (it is held, then delivered here)
        # and prints no traceback from the child's start-up
        with _sigint_blocked():
            self.proc.start()
        down_recv.close()  # the child holds its own ends
        up_send.close()
        self.max_queue = max_queue
        self.requests: dict[int, tuple[Sequence, asyncio.Queue]] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.running = self.waiting = 0
        self.sent = self.admitted = 0  # "add" messages sent / taken by the engine
        self.tickets = itertools.count()
        self.pending_metrics: dict[int, asyncio.Future] = {}
        self.gone: str | None = None  # why the engine process is no longer there
        self.stopping = False  # told to stop: its exit is no news
        # messages down go through a writer thread: a full pipe (long prompts while the engine
        # is in a long step) must not block the event loop
        self.outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self.writer = threading.Thread(target=self._write, name="leapdecode-writer", daemon=True)
        self.writer.start()
        self.reader = threading.Thread(target=self._read, name="leapdecode-reader", daemon=True)

    def wait_ready(self) -> dict:
        """Block until the engine process has loaded; its info, or LeapDecodeError."""
        try:
            if self.up not in wait([self.up, self.proc.sentinel]):
                raise EOFError
            what, info = self.up.recv()
        except (EOFError, OSError):
            self.proc.join(timeout=5)
            raise LeapDecodeError(
                f"the engine process exited while loading (exit code "
                f"{self.proc.exitcode}): see the messages above"
            ) from None
        if what == "failed":
            self.proc.join(timeout=5)
            raise LeapDecodeError(info)
        return info

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.reader.start()

    def stop(self, wait_s: float = 10) -> None:
        """Tell the engine process to stop; ended by force after wait_s seconds."""
        self.stopping = True
        try:
            self._send(("stop",))
        except EngineGone:
            pass
        self.proc.join(timeout=wait_s)
        if self.proc.is_alive():
            self.proc.kill()  # it ignores SIGTERM (see engine_main)
            self.proc.join(timeout=5)

    def _send(self, message: tuple) -> None:
        if self.gone:
            raise EngineGone(self.gone)
        self.outgoing.put(message)

    def _write(self) -> None:
        while True:
            message = self.outgoing.get()
            try:
                self.down.send(message)
            except OSError:  # the engine process is gone: the reader reports it
                return
            if message[0] == "stop":
                return

    # ------------------------------------------------------------ on the loop
    def queued(self) -> int:
        """Requests sent and not yet running (as of the engine's last report)."""
        return self.waiting + self.sent - self.admitted

    def submit(self, seq: Sequence) -> asyncio.Queue[Event]:
        """Queue a request; its events arrive on the returned queue. Raises QueueFull, or
        EngineGone when the engine process has exited."""
        if self.queued() >= self.max_queue:
            self._send(("rejected",))
            raise QueueFull
        self._send(("add", seq.to_wire()))
        events: asyncio.Queue[Event] = asyncio.Queue()
        self.requests[seq.id] = (seq, events)
        self.sent += 1
        return events

    def abort(self, seq_id: int) -> None:
        if seq_id in self.requests and not self.gone:  # (once gone, nothing runs to abort)
            self._send(("abort", seq_id))

    async def metrics_text(self) -> bytes:
        """The engine's Prometheus text (asked of the engine process; answered between steps)."""
        ticket = next(self.tickets)
        self._send(("metrics", ticket))
        future = asyncio.get_running_loop().create_future()
        self.pending_metrics[ticket] = future
        try:
            return await asyncio.wait_for(future, timeout=30)
        finally:
            self.pending_metrics.pop(ticket, None)

    def _deliver(self, message: tuple) -> None:
        what, *rest = message
        if what == "metrics":
            future = self.pending_metrics.pop(rest[0], None)
            if future is not None and not future.done():
                future.set_result(rest[1])
            return
        events, self.running, self.waiting, self.admitted = rest
        for seq_id, tokens, finished, reason, stats, error in events:
            held = self.requests.get(seq_id)
            if held is None:
                continue
            seq, events = held
            seq.tokens.extend(tokens)
            if finished:
                del self.requests[seq_id]
                seq.finished, seq.finish_reason = True, reason
                if stats is not None:
                    seq.stats = stats
            events.put_nowait(Event(tokens, finished, error))

    def _lost(self, why: str) -> None:
        self.gone = why
        for seq, events in self.requests.values():
            seq.finished, seq.finish_reason = True, "error"
            events.put_nowait(Event([], True, f"internal error: {why}"))
        self.requests.clear()
        for future in self.pending_metrics.values():
            if not future.done():
                future.set_exception(EngineGone(why))
        self.pending_metrics.clear()

    # ----------------------------------------------------------- reader thread
    def _read(self) -> None:
        while True:
            try:
                # the pipe, or the process's end (a grandchild holding the pipe open would
                # hide it): messages it sent before it ended are read first
                if self.up not in wait([self.up, self.proc.sentinel]):
                    raise EOFError
                message = self.up.recv()
            except (EOFError, OSError):
                if self.stopping:
                    return
                self.proc.join(timeout=5)
                why = f"the engine process exited (exit code {self.proc.exitcode})"
                log.error("%s: restart the server", why)
                with contextlib.suppress(RuntimeError):  # the loop may be closed already
                    self.loop.call_soon_threadsafe(self._lost, why)
                return
            try:
                self.loop.call_soon_threadsafe(self._deliver, message)
            except RuntimeError:  # the loop has closed: the server is shutting down
                return
