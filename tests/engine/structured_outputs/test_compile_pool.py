"""compile_pool.CompilePool: at most max_workers compiles run; one given up on (abandon) stops
counting, so a compile that never ends cannot starve the ones after it; the number let go so is
bounded; shutdown cancels what has not started."""

from __future__ import annotations

import threading

import pytest

from pagedserve.engine.structured_outputs.compile_pool import CompilePool


@pytest.fixture
def gates():
    """Events that hold compiles until set; all are set at the end (no thread outlives a test)."""
    events: list[threading.Event] = []

    def gate() -> threading.Event:
        events.append(threading.Event())
        return events[-1]

    yield gate
    for event in events:
        event.set()


def test_at_most_max_workers_run_and_the_rest_wait_their_turn(gates):
    pool = CompilePool(max_workers=2)
    held = [gates() for _ in range(3)]
    futures = [pool.submit(event.wait, 30) for event in held]
    assert [f.started_at is not None for f in futures] == [True, True, False]
    held[0].set()
    assert futures[0].result(timeout=10) is True
    held[2].set()
    assert futures[2].result(timeout=10) is True  # it started once a slot came free


def test_an_abandoned_compile_frees_its_slot_and_runs_on_unheard(gates):
    pool = CompilePool(max_workers=2)
    stuck = [gates(), gates()]
    never_ending = [pool.submit(event.wait, 60) for event in stuck]
    quick = pool.submit(lambda: "compiled")
    assert quick.started_at is None  # both threads are held
    assert pool.abandon(never_ending[0]) and not pool.abandon(never_ending[0])  # (once)
    assert quick.result(timeout=10) == "compiled"
    assert pool.num_abandoned == 1
    stuck[0].set()  # the abandoned compile still ends, and frees nothing twice
    assert never_ending[0].result(timeout=10) is True
    assert [pool.submit(lambda: 1).result(timeout=10) for _ in range(3)] == [1, 1, 1]


def test_the_threads_let_go_are_bounded(gates):
    pool = CompilePool(max_workers=1, max_abandoned=1)
    first, second = gates(), gates()
    a = pool.submit(first.wait, 60)
    assert pool.abandon(a)
    b = pool.submit(second.wait, 60)
    assert b.started_at is not None and not pool.abandon(b)  # the bound is reached: b keeps its slot
    c = pool.submit(lambda: "late")
    assert c.started_at is None
    second.set()
    assert c.result(timeout=10) == "late"


def test_a_finished_or_unknown_future_is_not_abandoned():
    pool = CompilePool(max_workers=1)
    done = pool.submit(lambda: 3)
    assert done.result(timeout=10) == 3 and not pool.abandon(done)
    assert pool.num_abandoned == 0


def test_shutdown_cancels_the_queue(gates):
    pool = CompilePool(max_workers=1)
    held = gates()
    running, queued = pool.submit(held.wait, 30), pool.submit(lambda: "never")
    pool.shutdown()
    assert queued.cancelled()
    held.set()
    assert running.result(timeout=10) is True
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: None)
