"""One embedded engine in a child process: the local backend's rollouts without a shared GIL.

With ``rl.backend = "local"`` the engine's decoding thread, the event loop that plays the
episodes (chat formatting, tool calls, sandboxes) and the trainer's thread share one
interpreter, and each waits for the others' Python between torch ops: on the demo's
model a trainer step took 4.73 s beside an engine thread, 4.13 s beside an engine process
and 3.83 s alone. With ``rl.backend = "process"`` the whole inference side is a
`RolloutWorker` (the body of a Ray rollout actor) in a spawned child process with its own
torch threads: it reaches the run's newest version with one pull, then follows the run's
weight store by itself (told after each publish), and only requests, finished groups (wire
messages), version numbers and stats cross its pipes. The child ends with this process
(`end_with_parent`); a child that dies fails every call waiting on it and stops the run
with its exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import pickle
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import structlog

from tandem.orchestrator.backends.ray.worker import RolloutWorker, WorkerSpec
from tandem.orchestrator.runtime.lifetime import end_with_parent
from tandem.orchestrator.runtime.worker_logging import driver_log_level
from tandem.orchestrator.wire import PlayedGroup, RolloutStats, decode

log = structlog.get_logger()

STOP_S = 60.0
"""How long `close` waits for the child to close its engine and sandboxes before killing it."""


class RolloutProcessFailed(RuntimeError):
    """The rollout process raised (the message carries its traceback) or died."""


@dataclass(frozen=True)
class _ChildArgs:
    spec: WorkerSpec
    parent: int
    torch_threads: int
    poll_s: float | None
    log_level: int


class ProcessRollouts:
    """`Rollouts` played by one engine in a child process (same interface as `LocalRollouts`).

    The child is spawned by `start` (a forked torch whose thread pool has run can hang) and
    takes about 2 s to import, build its engine and pull the weights. ``version`` is the
    newest version the child's engine has applied (it reports each one as it applies it).
    Its log events are logged by this process, as if they were its own."""

    def __init__(self, spec: WorkerSpec, *, torch_threads: int, poll_s: float | None = None):
        self.spec, self.torch_threads, self.poll_s = spec, torch_threads, poll_s
        self._version = -1
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._gone: asyncio.Event | None = None
        self._closing = False
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._outbox: Connection | None = None  # written on the event loop's thread only

    @property
    def version(self) -> int:
        return self._version

    @property
    def pid(self) -> int | None:
        """The child's process id (None before `start`)."""
        return None if self._proc is None else self._proc.pid

    async def start(self, *, follow: bool) -> list[asyncio.Task[Any]]:
        """Spawn the child, build its engine on the store's newest version and start it
        serving; returns the task that fails when the child dies."""
        loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")
        child_in, self._outbox = ctx.Pipe(duplex=False)
        inbox, child_out = ctx.Pipe(duplex=False)
        args = _ChildArgs(
            spec=self.spec,
            parent=os.getpid(),
            torch_threads=self.torch_threads,
            poll_s=self.poll_s,
            log_level=driver_log_level(),
        )
        self._proc = ctx.Process(
            target=_child_main, args=(args, child_in, child_out), name="tandem-rollouts"
        )
        self._proc.daemon = True
        self._proc.start()
        child_in.close()  # this process keeps only its own ends: EOF when the child dies
        child_out.close()
        self._gone = asyncio.Event()
        _deliver_in_loop(inbox, loop, self._on_message, "tandem-rollouts-reader")
        watcher = asyncio.create_task(self._watch())
        self._version = max(self._version, await self._call("start", follow))
        log.info("rl.rollout_process", pid=self._proc.pid, version=self._version)
        return [watcher]

    async def play(self, index: int, min_version: int = -1) -> PlayedGroup:
        return decode(await self._call("play", index, min_version), PlayedGroup)

    def published(self) -> None:
        self._send(("published", -1, ()))

    async def sync_to(self, version: int) -> None:
        self._version = max(self._version, await self._call("sync_to", version))

    async def stats(self) -> RolloutStats:
        stats: RolloutStats = await self._call("stats")
        return stats

    async def close(self) -> None:
        """Close the child's engine and sandboxes and wait for it to exit (killed after
        `STOP_S`)."""
        if self._proc is None:
            return
        self._closing = True
        with contextlib.suppress(RolloutProcessFailed, TimeoutError):
            await asyncio.wait_for(self._call("stop"), STOP_S)
        await asyncio.to_thread(self._proc.join, STOP_S)
        if self._proc.is_alive():
            log.warning("rl.rollout_process_killed", pid=self._proc.pid)
            self._proc.kill()
            await asyncio.to_thread(self._proc.join)
        if self._outbox is not None:
            self._outbox.close()

    async def _call(self, op: str, *args: Any) -> Any:
        if self._gone is not None and self._gone.is_set():
            raise RolloutProcessFailed(self._exit_reason())
        rid = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        try:
            self._send((op, rid, args))
            return await future
        finally:
            self._pending.pop(rid, None)

    def _send(self, message: tuple[str, int, tuple[Any, ...]]) -> None:
        if self._outbox is None:
            raise RuntimeError("the rollout process was not started")
        try:
            self._outbox.send(message)
        except (BrokenPipeError, OSError) as e:
            raise RolloutProcessFailed(self._exit_reason()) from e

    def _on_message(self, message: tuple[str, int, Any] | None) -> None:
        if message is None:  # the child's end of the pipe closed: it exited
            self._on_exit()
            return
        kind, rid, value = message
        if kind == "version":
            self._version = max(self._version, value)
            return
        if kind == "log":
            method, event = value
            getattr(log, method, log.info)(event.pop("event", "rollouts.event"), **event)
            return
        future = self._pending.get(rid)
        if future is None or future.done():
            return
        if kind == "reply":
            future.set_result(value)
        else:
            future.set_exception(RolloutProcessFailed(f"the rollout process failed:\n{value}"))

    def _on_exit(self) -> None:
        assert self._gone is not None
        self._gone.set()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(RolloutProcessFailed(self._exit_reason()))

    def _exit_reason(self) -> str:
        code = None if self._proc is None else self._proc.exitcode
        if code is None and self._proc is not None:
            self._proc.join(1.0)  # its pipe closed: it is exiting
            code = self._proc.exitcode
        return f"the rollout process (pid {self.pid}) exited, code {code}"

    async def _watch(self) -> None:
        assert self._gone is not None
        await self._gone.wait()
        if not self._closing:
            raise RolloutProcessFailed(self._exit_reason())


def _child_main(args: _ChildArgs, inbox: Connection, outbox: Connection) -> None:
    """The child: a `RolloutWorker` serving the parent's requests until ``stop`` or EOF.

    It ignores SIGINT: Ctrl-C in a terminal reaches the whole process group, and the parent
    stops a run cleanly on it (finishing the step, writing a checkpoint) while this engine
    still serves it; the parent ends the child on `close`, or the kernel with the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    end_with_parent(args.parent)
    lock = threading.Lock()  # replies from the loop; versions and logs from other threads

    def send(message: tuple[str, int, Any]) -> None:
        with lock:
            outbox.send(message)

    structlog.configure(
        processors=[_to_parent(send)],
        wrapper_class=structlog.make_filtering_bound_logger(args.log_level),
    )
    asyncio.run(_serve(args, inbox, send))


def _to_parent(send: Callable[[tuple[str, int, Any]], None]) -> Callable[..., Any]:
    """A structlog processor that hands each event to the parent to log, and drops it here."""

    def forward(_logger: Any, method: str, event: dict[str, Any]) -> Any:
        try:
            send(("log", -1, (method, event)))
        except (TypeError, AttributeError, pickle.PicklingError):  # a value that cannot cross
            send(("log", -1, (method, {k: repr(v) for k, v in event.items()})))
        raise structlog.DropEvent

    return forward


async def _serve(
    args: _ChildArgs, inbox: Connection, send: Callable[[tuple[str, int, Any]], None]
) -> None:
    worker = RolloutWorker(args.spec, "process", args.torch_threads, args.poll_s)
    loop = asyncio.get_running_loop()
    requests: asyncio.Queue[tuple[str, int, tuple[Any, ...]] | None] = asyncio.Queue()

    async def handle(op: str, rid: int, call: tuple[Any, ...]) -> None:
        try:
            if op == "start":
                value: Any = await worker.start(
                    follow=call[0], on_apply=lambda version: send(("version", -1, version))
                )
            elif op == "play":
                value = await worker.play(*call)
            elif op == "sync_to":
                value = await worker.sync_to(*call)
            elif op == "stats":
                value = await worker.stats()
            else:
                raise ValueError(f"unknown request {op!r}")
            send(("reply", rid, value))
        except Exception:
            send(("error", rid, traceback.format_exc()))

    _deliver_in_loop(inbox, loop, requests.put_nowait, "tandem-rollouts-requests")
    running: set[asyncio.Task[None]] = set()
    stop_id = None
    while (message := await requests.get()) is not None:
        op, rid, call = message
        if op == "published":
            worker.published()
        elif op == "stop":
            stop_id = rid
            break
        else:
            task = asyncio.create_task(handle(op, rid, call))
            running.add(task)
            task.add_done_callback(running.discard)
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    await worker.stop()
    if stop_id is not None:
        send(("reply", stop_id, None))


def _deliver_in_loop(
    conn: Connection,
    loop: asyncio.AbstractEventLoop,
    deliver: Callable[[Any], None],
    name: str,
) -> None:
    """A daemon thread that hands each message read from ``conn`` to ``deliver`` on ``loop``'s
    thread, and then None once the other end has closed (both sides read their pipe so)."""

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            loop.call_soon_threadsafe(deliver, message)
        with contextlib.suppress(RuntimeError):  # the loop may have closed already
            loop.call_soon_threadsafe(deliver, None)

    threading.Thread(target=read, name=name, daemon=True).start()
