"""The engine stream's item union (cluster/stream_items.py), and that the handover's own item
(`Moved`, one attempt's end) never reaches a caller of ResumingClient."""

from __future__ import annotations

import pickle
from typing import get_args

from pagedserve.cluster.handover import AttemptItem, Moved
from pagedserve.cluster.stream_items import ErrorInfo, Handover, StreamItem, overloaded
from pagedserve.engine.request_output import RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from tests.cluster.test_drain_client import item, run


def test_a_stream_carries_outputs_refusals_and_handovers_and_an_attempt_may_also_move():
    assert set(get_args(StreamItem)) == {RequestOutput, ErrorInfo, Handover}
    assert set(get_args(AttemptItem)) == {RequestOutput, ErrorInfo, Handover, Moved}


def test_an_overload_is_a_503_the_client_may_retry():
    info = overloaded("busy")
    assert (info.status, info.type, info.message, info.retry_after_s) == (503, "ServiceUnavailableError", "busy", 1)


def test_items_cross_the_process_boundary_unchanged():
    """Serve pickles every item from the replica to the ingress."""
    for value in (ErrorInfo(400, "bad", param="n"), Handover("replica-1"), Handover()):
        assert pickle.loads(pickle.dumps(value)) == value


def test_a_stream_moved_twice_shows_its_caller_only_stream_items():
    params = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.DELTA)
    scripts = [[item("a", [1]), "leave"], [item("b", [2]), "leave"], [item("c", [3], finished=True)]]
    items, calls = run(scripts, params)
    assert len(calls) == 3 and "".join(i.outputs[0].text for i in items) == "abc"
    assert all(isinstance(i, get_args(StreamItem)) for i in items)
