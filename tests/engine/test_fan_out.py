"""The n > 1 fan-out: one definition of a request's children, which the output processor, the
engine core and the cluster's handover all use."""

from __future__ import annotations

from pagedserve.engine.fan_out import child_ids, child_params, fan_out
from pagedserve.sampling_params import SamplingParams


def test_one_sample_is_the_request_itself():
    params = SamplingParams(seed=7)
    [child] = fan_out("r", params)
    assert (child.index, child.request_id, child.params) == (0, "r", params)
    assert child_ids("r", 1) == ["r"]


def test_n_samples_are_n_one_sample_children_with_their_own_seeds():
    children = fan_out("r", SamplingParams(n=3, seed=10))
    assert [c.request_id for c in children] == child_ids("r", 3) == ["0_r", "1_r", "2_r"]
    assert [c.index for c in children] == [0, 1, 2]
    assert [(c.params.n, c.params.seed) for c in children] == [(1, 10), (1, 11), (1, 12)]


def test_a_choice_gets_the_params_its_child_had():
    """The handover moves choice i as a request of its own: it must run as child i ran."""
    params = SamplingParams(n=4, seed=3, temperature=0.8)
    assert [child_params(params, i) for i in range(4)] == [c.params for c in fan_out("r", params)]
