"""A stream's next item, raced against an event (a replica leaving, a drain's deadline)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

RIVAL_FIRST = object()  # what `next_unless` returns when the rival completes first


async def next_unless(stream: AsyncIterator[Any], rival: asyncio.Future | None) -> Any:
    """The stream's next item (None at its end), or RIVAL_FIRST if `rival` completes first.

    The read runs as a task of its own. However this returns, cancelled included, a read still
    in flight is cancelled and waited for: an async generator cannot be closed while a read runs
    in it (`aclose` raises RuntimeError), and the caller's cleanup closes the stream next. Left
    running, the stream would close only when the garbage collector came to it; a disconnected
    client's request decoded on for ~0.5 s that way."""
    read = asyncio.ensure_future(anext(stream, None))
    try:
        await asyncio.wait({read} if rival is None else {read, rival}, return_when=asyncio.FIRST_COMPLETED)
        if read.done():
            return read.result()
    finally:
        if not read.done():
            await cancel_and_wait(read)
    return RIVAL_FIRST


async def cancel_and_wait(task: asyncio.Future) -> None:
    """Cancel `task` and wait until it has ended, whatever it ends with. A cancellation of the
    caller meanwhile still reaches the caller (asyncio.wait, unlike awaiting the task, does not
    turn the task's own CancelledError into the caller's)."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: the read's failure is of no interest once it is abandoned
