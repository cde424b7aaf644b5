"""next_unless: a stream's next item raced against an event, leaving the stream closable."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.cluster.stream_race import RIVAL_FIRST, next_unless


class Stream:
    """An async generator of `count` items, one per `interval` s, that records its closing."""

    def __init__(self, count: int, interval: float):
        self.closed = False
        self.iterator = self._items(count, interval)

    async def _items(self, count: int, interval: float):
        try:
            for i in range(count):
                await asyncio.sleep(interval)
                yield i
        finally:
            self.closed = True


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=10))


def test_items_then_none_at_the_end():
    async def main():
        stream, rival = Stream(2, 0.0), asyncio.get_running_loop().create_future()
        return [await next_unless(stream.iterator, rival) for _ in range(3)]

    assert run(main()) == [0, 1, None]


def test_a_rival_first_cancels_the_read_and_the_stream_can_be_closed():
    async def main():
        stream = Stream(5, 60.0)
        rival = asyncio.ensure_future(asyncio.sleep(0.01))
        assert await next_unless(stream.iterator, rival) is RIVAL_FIRST
        await stream.iterator.aclose()  # would raise "already running" with the read left in flight
        return stream.closed

    assert run(main())


def test_a_cancelled_caller_leaves_no_read_running():
    """The disconnect path: the client goes while the read waits; the caller's cleanup must be
    able to close the stream at once, not when the garbage collector finds it."""

    async def main():
        stream = Stream(5, 60.0)

        async def caller():
            try:
                await next_unless(stream.iterator, None)
            finally:
                await stream.iterator.aclose()

        task = asyncio.create_task(caller())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return stream.closed

    assert run(main())


def test_a_failed_read_raises_to_the_caller():
    async def failing():
        raise ValueError("broken")
        yield  # an async generator

    with pytest.raises(ValueError, match="broken"):
        run(next_unless(failing(), None))
