"""Request timeouts: one periodic check per event loop expires overdue waits, and a sandbox
that stops answering is reported as lost, not waited for forever."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tandem.agent_env import Env, EnvConfig, generate_tasks
from tandem.agent_env.sandbox.deadlines import PERIOD_S, deadlines
from tandem.agent_env.sandbox.session import SessionLost


def test_only_overdue_waits_expire_and_the_timer_stops_when_nothing_waits() -> None:
    async def main() -> tuple[list[str], bool, bool]:
        fired: list[str] = []
        watch = deadlines()
        assert deadlines() is watch  # one per loop
        watch.add("soon", 0.05, lambda: fired.append("soon"))
        watch.add("late", 3600.0, lambda: fired.append("late"))
        watch.add("dropped", 0.05, lambda: fired.append("dropped"))
        watch.discard("dropped")
        await asyncio.sleep(3 * PERIOD_S)
        armed_while_waiting = watch._timer is not None
        watch.discard("late")
        await asyncio.sleep(2 * PERIOD_S)
        return fired, armed_while_waiting, watch._timer is None

    fired, armed, stopped = asyncio.run(main())
    assert fired == ["soon"]
    assert armed and stopped


def test_a_supervisor_that_stops_answering_is_a_lost_session(config: EnvConfig) -> None:
    task = generate_tasks(3, 1)[0]

    async def main() -> str:
        env = Env(task, config)
        await env.reset()
        try:
            session = env._session
            assert session is not None and session.cgroup is not None
            for pid in session.cgroup.pids():  # frozen: alive, but it never answers
                os.kill(pid, signal.SIGSTOP)
            with pytest.raises(SessionLost) as lost:
                await session.request({"op": "list_dir"}, 1.0)
            return str(lost.value)
        finally:
            await env.close()

    assert "no answer within 1 s" in asyncio.run(main())
