"""`Env`: one multi-turn episode of an agent fixing a repository through tools."""

from __future__ import annotations

import secrets
import time
from typing import Any

import structlog

from tandem.agent_env.config import EnvConfig
from tandem.agent_env.errors import SandboxError
from tandem.agent_env.grading import GradeResult, grade
from tandem.agent_env.opening import opening_messages
from tandem.agent_env.replies import TEXT_ANSWER_OBSERVATION, assistant_message, to_turn
from tandem.agent_env.sandbox.answers import BadAnswer, Done, Failed, Ran, check
from tandem.agent_env.sandbox.runtime import Runtime
from tandem.agent_env.sandbox.session import Session, SessionLost, os_signal_name
from tandem.agent_env.task import Task
from tandem.agent_env.tools import (
    ToolCall,
    ToolCallError,
    cap_observation,
    parse_call,
    tool_schemas,
    without_durations,
)
from tandem.agent_env.trajectory import Observation, StepRecord, StepResult, Trajectory

log = structlog.get_logger()

_MAX_RESTARTS = 5
_ANSWER_GRACE_S = 15.0  # beyond the command's own limit: the supervisor's work around it


class Env:
    """A sandboxed episode: ``reset()``, then ``step(tool_call)`` until done, then ``close()``.

    Raises :class:`SandboxError` at the first ``reset()`` when no working sandbox is available,
    unless ``allow_unsandboxed=True`` (then commands run as plain subprocesses of this host
    with rlimits only: for trusted code and development machines).
    """

    def __init__(
        self,
        task: Task,
        config: EnvConfig | None = None,
        *,
        allow_unsandboxed: bool | None = None,
        runtime: Runtime | None = None,
    ) -> None:
        self.task = task
        self.config = config or EnvConfig()
        self.allow_unsandboxed = (
            self.config.allow_unsandboxed if allow_unsandboxed is None else allow_unsandboxed
        )
        self._runtime = runtime
        self._session: Session | None = None
        lim = task.limits
        self.max_turns = lim.max_turns or self.config.max_turns
        self.wall_s = lim.episode_wall_s or self.config.episode_wall_s
        self.grade_timeout_s = lim.grade_timeout_s or self.config.grade_timeout_s
        self.messages: list[dict[str, Any]] = []
        self.steps: list[StepRecord] = []
        self.turn = 0
        self.done = False
        self.termination = ""
        self.result: GradeResult | None = None
        self._t0 = 0.0
        self._restarts = 0
        self._counters = (0, 0)
        self._call_prefix = ""  # drawn by reset()

    @staticmethod
    def tool_schemas() -> list[dict[str, Any]]:
        return tool_schemas()

    def _get_runtime(self) -> Runtime:
        if self._runtime is None:
            try:
                self._runtime = Runtime.shared(self.config.sandbox, sandboxed=True)
            except SandboxError as e:
                if not self.allow_unsandboxed:
                    raise
                log.warning("agent_env.unsandboxed", reason=str(e))
                self._runtime = Runtime.shared(self.config.sandbox, sandboxed=False)
        return self._runtime

    async def reset(self) -> Observation:
        """Start a fresh episode (a new sandbox over the task's base) and return the task."""
        await self.close()
        rt = self._get_runtime()
        base = rt.acquire_base(self.task)
        self._session = Session(rt, base, rt.episode_dir(), rt.config.limits)
        self.messages = opening_messages(self.task, self.config)
        self.steps, self.turn, self.done, self.termination, self.result = [], 0, False, "", None
        self._restarts = 0
        self._counters = (0, 0)
        self._call_prefix = secrets.token_hex(5)  # ids unique per episode, one draw per reset
        self._t0 = time.monotonic()
        try:
            await self._session.start()
        except SessionLost as e:
            await self._session.discard()
            self._session = None
            raise SandboxError(
                f"could not start the sandbox for task {self.task.id}: {e}"
            ) from None
        return Observation(self.task.instruction)

    # -- tools ---------------------------------------------------------------------------

    async def _request(
        self, req: dict[str, Any], timeout: float, kind: type[Ran] | type[Done]
    ) -> Ran | Done | Failed:
        """Send a request; the answer checked against its schema (a malformed one is a
        lost sandbox: `SessionLost`, and the sandbox is stopped for a restart)."""
        assert self._session is not None
        answer = await self._session.request(req, timeout)
        try:
            return check(answer, kind)
        except BadAnswer as e:
            await self._session.halt()
            raise SessionLost(str(e)) from None

    def _remaining(self) -> float:
        return self.wall_s - (time.monotonic() - self._t0)

    async def _exec(self, req: dict[str, Any]) -> tuple[Observation, dict[str, Any]]:
        assert self._session is not None
        lim = self._session.limits
        budget = max(1.0, min(lim.command_timeout_s, self._remaining()))
        req["timeout"] = budget
        res = await self._request(req, budget + _ANSWER_GRACE_S, Ran)
        if isinstance(res, Failed):
            return Observation(f"error: {res.error}", True), {}
        assert isinstance(res, Ran)
        code = res.exit_code
        notes = []
        oom = pids = False
        if code != 0:  # limit counters are only read when something failed (cheap path first)
            oom0, pids0 = self._counters
            self._counters = (self._session.oom_kills(), self._session.pids_limit_hits())
            oom, pids = self._counters[0] > oom0, self._counters[1] > pids0
        if res.timed_out:
            notes.append(f"killed: still running after {budget:.0f} s (wall-clock limit)")
        if res.output_limit:
            notes.append(f"killed: produced more than {lim.max_output_bytes >> 20} MiB of output")
        if oom:
            notes.append(
                f"out of memory: a process was killed at the {lim.memory_bytes >> 20} MiB limit"
            )
        if pids:
            notes.append(f"process limit reached: fork failed at {lim.pids} processes")
        if code < 0 and not res.timed_out and not res.output_limit:
            notes.append(f"killed by {os_signal_name(code)}")
        notes.append(f"exit code {code}")
        if res.shell_restarted:
            notes.append(
                "the shell "
                + ("exited" if res.shell_exited else "was killed")
                + f"; a new one will start in {res.cwd[:300]} with the exported variables "
                "(files are kept, background processes are gone)"
            )
        text = (res.output.rstrip("\n") + "\n" if res.output else "") + "[" + "; ".join(notes) + "]"
        info = {"exit_code": code, "timed_out": res.timed_out, "output_bytes": res.bytes}
        return Observation(text, code != 0), info

    async def _file_op(self, req: dict[str, Any]) -> tuple[Observation, dict[str, Any]]:
        # the supervisor gives up on a file or search at the command limit; this side waits
        # that long plus a grace, never a fixed time of its own
        assert self._session is not None
        limit = max(1.0, min(self._session.limits.command_timeout_s, self._remaining()))
        req["timeout"] = limit
        res = await self._request(req, limit + _ANSWER_GRACE_S, Done)
        if isinstance(res, Failed):
            return Observation(f"error: {res.error}", True), {}
        if req["op"] == "search":
            return Observation(res.output, res.exit_code > 1), {}
        return Observation(res.output), {}

    async def _dispatch(
        self, name: str, args: dict[str, Any]
    ) -> tuple[Observation, dict[str, Any]]:
        if name == "bash":
            return await self._exec({"op": "shell", "cmd": args["command"]})
        if name == "run_tests":
            obs, info = await self._exec({"op": "exec", "cmd": self.task.visible_test_command})
            return Observation(without_durations(obs.content), obs.is_error), info
        if name == "submit":
            return Observation("submitted"), {}
        return await self._file_op({"op": name, **args})  # read_file, search, list_dir, edit, ...

    # -- episode -------------------------------------------------------------------------

    def _call_ids(self, calls: tuple[ToolCall, ...]) -> list[str]:
        """The calls' own ids, or fresh ones where missing or repeated within the turn."""
        base = f"call_{self._call_prefix}{self.turn:03d}"
        ids: list[str] = []
        for i, c in enumerate(calls):
            ids.append(c.id if c.id and c.id not in ids else base + (f"_{i + 1}" if i else ""))
        return ids

    async def _run_call(self, call: ToolCall) -> tuple[Observation, dict[str, Any], str]:
        """Validate and run one call: (observation, info, infra error or ""). Every
        observation goes through the output cap."""
        obs, info, infra = await self._run_uncapped(call)
        assert self._session is not None or infra
        lim = self._session.limits if self._session is not None else self.config.sandbox.limits
        text = cap_observation(obs.content, lim.output_head_chars, lim.output_tail_chars)
        if text is not obs.content:
            obs = Observation(text, obs.is_error)
        return obs, info, infra

    async def _run_uncapped(self, call: ToolCall) -> tuple[Observation, dict[str, Any], str]:
        try:
            args = parse_call(call.name, call.arguments)
        except ToolCallError as e:
            return Observation(f"error: {e}", True), {"malformed": True}, ""
        try:
            obs, info = await self._dispatch(call.name, args)
        except SessionLost as e:
            obs, infra_error = await self._recover(str(e))
            return obs, {}, infra_error
        except Exception as e:  # a bug of ours or bytes nobody expected: this sandbox only
            log.warning("agent_env.tool_failed", task=self.task.id, error=repr(e)[:300])
            assert self._session is not None
            await self._session.halt()
            obs, infra_error = await self._recover(f"{type(e).__name__}")
            return obs, {}, infra_error
        return obs, info, ""

    async def step(self, reply: Any) -> StepResult:
        """Play one assistant turn; when the episode ends, grade it and return the reward.

        ``reply`` is what a policy returns (see `tandem.agent_env.replies`): a `ToolCall`,
        an OpenAI tool call or assistant message (dict or SDK object), a list of calls, or a
        str. A turn is one assistant message, however many calls it makes: it counts once
        against ``max_turns``. Its calls run in order, each answered by its own ``tool``
        message (``observations``, one per call; ``observation`` is the last one that ran).
        After a ``submit``, a lost sandbox or the end of the time budget, the turn's later
        calls are not run; each is answered "not run: ...". A text-only answer costs the
        turn and is answered by `TEXT_ANSWER_OBSERVATION` as a ``user`` message. Anything
        else raises ``TypeError`` and changes nothing.
        """
        if self._session is None or self.done:
            raise SandboxError(
                "step() called on an episode that is not running: call reset() first"
            )
        t0 = time.monotonic()
        turn = to_turn(reply)
        self.turn += 1
        ids = self._call_ids(turn.calls)
        self.messages.append(assistant_message(turn, ids))
        if not turn.calls:
            obs, info = Observation(TEXT_ANSWER_OBSERVATION, True), {"text_answer": True}
            self.messages.append({"role": "user", "content": obs.content})
            self.steps.append(StepRecord(self.turn, "", True, time.monotonic() - t0, info))
            return await self._end_turn(obs, info, [obs], "", submitted=False)
        observations: list[Observation] = []
        last, last_info = Observation(""), {}  # the last call that ran (the first always runs)
        stopped = infra_error = ""
        submitted = False
        for i, (call, call_id) in enumerate(zip(turn.calls, ids, strict=True)):
            t1 = time.monotonic()
            if not stopped and i and self._remaining() <= 0:
                stopped = "the episode's time budget ran out"
            if stopped:
                obs = Observation(f"not run: {stopped} before this call", True)
                info = {"not_run": True}
            else:
                obs, info, infra_error = await self._run_call(call)
                last, last_info = obs, info
                if infra_error:
                    stopped = "the sandbox was lost"
                elif call.name == "submit" and not obs.is_error and not info.get("malformed"):
                    submitted, stopped = True, "submit ended the episode"
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": obs.content})
            self.steps.append(
                StepRecord(
                    self.turn,
                    call.name,
                    obs.is_error,
                    time.monotonic() - t1,
                    info,
                    dict(call.metadata),
                )
            )
            observations.append(obs)
        return await self._end_turn(last, last_info, observations, infra_error, submitted)

    async def _end_turn(
        self,
        obs: Observation,
        info: dict[str, Any],
        observations: list[Observation],
        infra_error: str,
        submitted: bool,
    ) -> StepResult:
        seen = tuple(observations)
        if infra_error:
            return await self._finish("infra_fault", obs, seen, infra=infra_error)
        if submitted:
            return await self._finish("submitted", obs, seen)
        if self.turn >= self.max_turns:
            return await self._finish("turn_limit", obs, seen)
        if self._remaining() <= 0:
            return await self._finish("wall_limit", obs, seen)
        return StepResult(obs, False, None, info, seen)

    async def _recover(self, reason: str) -> tuple[Observation, str]:
        """The supervisor died mid-call: restart it over the same workspace if we can."""
        assert self._session is not None
        self._restarts += 1
        if self._restarts > _MAX_RESTARTS:
            return Observation(f"error: the sandbox was lost again ({reason})", True), ""
        try:
            await self._session.start()
        except SessionLost as e:
            return Observation(f"error: the sandbox was lost ({reason})", True), str(e)
        text = (
            f"error: the sandbox's shell died during this call ({reason}); a new one was started. "
            "Files in the workspace are kept; background processes are gone."
        )
        return Observation(text, True), ""

    async def _finish(
        self,
        reason: str,
        obs: Observation,
        observations: tuple[Observation, ...] = (),
        infra: str = "",
    ) -> StepResult:
        assert self._session is not None
        self.done = True
        self.termination = reason
        await self._session.stop()
        if infra:
            self.result = GradeResult(None, False, {}, True, infra)
        else:
            self.result = await grade(
                self._session.runtime,
                self.task,
                self._session,
                self.grade_timeout_s,
                self.config.partial_credit,
            )
            if self.result.infra_fault:
                self.termination = "infra_fault"
        r = self.result
        info = {
            "termination": self.termination,
            "tests": r.tests,
            "resolved": r.resolved,
            "infra_fault": r.infra_fault,
        }
        if r.detail:
            info["grade_detail"] = r.detail
        await self._session.discard()
        return StepResult(obs, True, r.reward, info, observations or (obs,))

    def trajectory(self) -> Trajectory:
        r = self.result
        return Trajectory(
            task_id=self.task.id,
            messages=list(self.messages),
            steps=list(self.steps),
            termination=self.termination or "running",
            reward=r.reward if r else None,
            resolved=bool(r and r.resolved),
            infra_fault=bool(r and r.infra_fault),
            test_results=dict(r.tests) if r else {},
            turns=self.turn,
            wall_s=time.monotonic() - self._t0 if self._t0 else 0.0,
            grade_detail=r.detail if r else "",
            metadata=dict(self.task.metadata),
        )

    async def close(self) -> None:
        """Kill the sandbox and delete the episode's files (safe to call twice)."""
        if self._session is not None:
            session, self._session = self._session, None
            if not self.done:
                self.termination = self.termination or "closed"
            await session.discard()

    async def __aenter__(self) -> Env:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
