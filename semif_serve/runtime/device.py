"""`DeviceQueue`: one device shared by every model's engine, taken in turn, first come first served.

Without SEMIF_PARALLEL_SLOTS every scorer call of every model runs alone (INV-2). The device is
then one more queue a request waits in, after its model's: in arrival order, within the same
deadline, leaving it when its caller goes (`take`). The engines and the warm-up hold it too,
as a plain lock (`with queue:`); a thread that holds its turn may take it again (the runtime
takes the turn for a request, and the engine's own call then finds it held), so a scorer call
never overlaps another and never waits for itself.
"""

from __future__ import annotations

import threading
from collections import deque

from semif_serve.runtime.waiting import NEVER, Deadline, Gone, wait_until


class DeviceQueue:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[int] = deque()  # waiting threads' ids, first come first
        self._owner: int | None = None  # the thread whose turn it is
        self._depth = 0  # how many times it took its turn

    def take(self, deadline: Deadline = NEVER, gone: Gone | None = None) -> bool:
        """Wait for this thread's turn (FIFO), within `deadline`, while `gone` says the caller
        stays (`QueueTimeout`, `WaiterGone`); on every way out but its turn it leaves the queue.
        True when it had to wait (the device was another's)."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return False
            if self._owner is None and not self._queue:
                self._owner, self._depth = me, 1
                return False
            self._queue.append(me)  # a thread waits for one turn at a time: its id is its ticket
            try:
                wait_until(
                    self._cond,
                    lambda: self._queue[0] == me and self._owner is None,
                    deadline,
                    gone,
                    "the device (another model's call held it)",
                )
            except BaseException:
                self._queue.remove(me)
                self._cond.notify_all()  # the waiter behind may now be at the head
                raise
            self._queue.popleft()
            self._owner, self._depth = me, 1
            return True

    def give(self) -> None:
        """End this thread's turn (its last `take`): the next in the queue goes."""
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("the device turn is not this thread's")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    def __enter__(self) -> DeviceQueue:
        self.take()
        return self

    def __exit__(self, *exc: object) -> None:
        self.give()

    @property
    def waiting(self) -> int:
        return len(self._queue)
