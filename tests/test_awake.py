"""`maxsim_cli.service.awake.Awake`: the event loop turns while an answer is due and for ``linger_s``
after, never when off, and stops turning while paused."""

from __future__ import annotations

import asyncio

from maxsim_cli.service.awake import Awake


def test_off_makes_no_task() -> None:
    async def main() -> None:
        awake = Awake(0.0)
        awake.linger()
        with awake.waiting():
            assert awake._task is None
        assert awake._task is None and not awake.on

    asyncio.run(main())


def test_linger_turns_for_its_time_then_stops() -> None:
    async def main() -> None:
        awake = Awake(0.02)
        awake.linger()
        assert awake._task is not None
        await asyncio.sleep(0.005)
        assert awake._task is not None  # still turning
        await asyncio.sleep(0.1)
        assert awake._task is None  # done: the loop sleeps again

    asyncio.run(main())


def test_waiting_turns_until_the_answer_then_lingers() -> None:
    async def main() -> None:
        awake = Awake(0.01)
        answer = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.03, answer.set_result, "done")
        with awake.waiting():
            assert await answer == "done"  # 3x the linger: turned all along
            assert awake._task is not None
        await asyncio.sleep(0.003)
        assert awake._task is not None  # lingering after the answer
        await asyncio.sleep(0.05)
        assert awake._task is None

    asyncio.run(main())


def test_paused_stops_turning_until_the_next_call() -> None:
    state = {"paused": False}

    async def main() -> None:
        awake = Awake(1.0, paused=lambda: state["paused"])
        awake.linger()
        await asyncio.sleep(0.005)
        assert awake._task is not None
        state["paused"] = True  # a batch on the scoring thread, or requests queued
        await asyncio.sleep(0.005)
        assert awake._task is None  # asleep, though its linger has not ended
        state["paused"] = False
        awake.linger()  # the next request announced
        await asyncio.sleep(0.005)
        assert awake._task is not None
        await awake.close()

    asyncio.run(main())


def test_several_answers_due_stop_turning() -> None:
    async def main() -> None:
        awake = Awake(1.0)
        loop = asyncio.get_running_loop()
        first, second = loop.create_future(), loop.create_future()

        async def wait(answer: asyncio.Future) -> None:
            with awake.waiting():
                await answer

        one = loop.create_task(wait(first))
        await asyncio.sleep(0.005)
        assert awake._task is not None  # one answer due: turning
        two = loop.create_task(wait(second))
        await asyncio.sleep(0.005)
        assert awake._task is None  # two due: the loop has work enough
        first.set_result(None)
        second.set_result(None)
        await asyncio.gather(one, two)
        await awake.close()

    asyncio.run(main())


def test_close_stops_a_turning_loop() -> None:
    async def main() -> None:
        awake = Awake(10.0)
        awake.linger()
        await asyncio.sleep(0)
        await awake.close()
        assert awake._task is None

    asyncio.run(main())
