"""Background tasks are stopped even when one swallows its cancellation."""

from __future__ import annotations

import asyncio

from tandem.orchestrator.runtime.cancel import cancel_and_wait


async def _stubborn(swallowed: list[int]) -> None:
    """A worker loop whose first cancellation is lost (as 3.11's wait_for can lose one)."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        swallowed.append(1)
    while True:
        await asyncio.sleep(0.01)


def test_a_task_that_swallows_a_cancel_is_cancelled_again() -> None:
    async def main() -> tuple[bool, list[int]]:
        swallowed: list[int] = []
        once = asyncio.create_task(_stubborn(swallowed))
        await asyncio.sleep(0.01)
        once.cancel()  # one cancel alone leaves it running
        done, _ = await asyncio.wait([once], timeout=0.3)
        still_running = not done
        await cancel_and_wait([once])
        assert once.cancelled()
        return still_running, swallowed

    still_running, swallowed = asyncio.run(main())
    assert still_running and swallowed == [1]


def test_finished_and_failed_tasks_are_waited_for_without_warnings() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    async def main() -> list[asyncio.Task[None]]:
        tasks = [asyncio.create_task(fails()), asyncio.create_task(asyncio.sleep(10))]
        await asyncio.sleep(0.01)
        await cancel_and_wait(tasks)
        return tasks

    failed, slept = asyncio.run(main())
    assert isinstance(failed.exception(), RuntimeError)
    assert slept.cancelled()
