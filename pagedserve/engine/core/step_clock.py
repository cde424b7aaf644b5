"""When the core's running step started, readable by the front end without a message.

The front end reports a step running longer than `step_timeout_s` as unhealthy (a wedged
worker). A wedged step sends nothing, so the start time lives in 8 bytes of memory both
processes map (a memfd the child inherits). time.monotonic() is one clock for the machine.
"""

from __future__ import annotations

import mmap
import os
import struct

_FORMAT = "d"  # 0.0: no step running


class StepClock:
    def __init__(self, fd: int | None = None):
        """No fd: make a new one (the front end); an inherited fd: map it (the core)."""
        if fd is None:
            fd = os.memfd_create("pagedserve-step-clock")
            os.ftruncate(fd, struct.calcsize(_FORMAT))
        self.fd = fd
        self._memory = mmap.mmap(fd, struct.calcsize(_FORMAT))

    def start(self, now: float) -> None:
        struct.pack_into(_FORMAT, self._memory, 0, now)

    def stop(self) -> None:
        struct.pack_into(_FORMAT, self._memory, 0, 0.0)

    @property
    def started(self) -> float | None:
        """time.monotonic() when the running step began; None between steps."""
        if self._memory.closed:
            return None
        value = struct.unpack_from(_FORMAT, self._memory, 0)[0]
        return value or None

    def close(self) -> None:
        self._memory.close()
        os.close(self.fd)
