"""Several async streams read as one, item by item as they come."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator


async def merge_streams(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Items of several streams as they come, each with its stream's position in `streams`. An
    exception in a stream ends the merge with it; closing the merge closes every stream."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(position: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((position, item))
            await queue.put((position, done))
        except Exception as error:  # surfaced by the merge, in its consumer's task
            await queue.put((position, _Failed(error)))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        num_left = len(tasks)
        while num_left:
            position, item = await queue.get()
            if isinstance(item, _Failed):
                raise item.error
            if item is done:
                num_left -= 1
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # each stream's own cleanup runs


@dataclass(frozen=True)
class _Failed:
    error: Exception
