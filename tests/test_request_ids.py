"""Request ids (pagedserve/request_ids.py): every shape parses back into what composed it, nested
as a real request's ids nest, and an id of another shape is refused by name."""

from __future__ import annotations

import re

import pytest

from pagedserve.request_ids import (
    child_request_id,
    choice_request_id,
    handover_request_id,
    new_response_id,
    prompt_request_id,
    split_child,
    split_handover,
    split_indexed,
)


def test_a_response_id_is_openais_shape_and_fresh():
    first, second = new_response_id("chatcmpl"), new_response_id("chatcmpl")
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", first) and first != second


@pytest.mark.parametrize("index", [0, 7, 128])
def test_each_shape_round_trips(index):
    response = new_response_id("cmpl")
    assert split_indexed(prompt_request_id(response, index)) == (response, index)
    assert split_indexed(choice_request_id(response, index)) == (response, index)
    assert split_child(child_request_id(response, index)) == (response, index)
    attempt = index + 1
    assert split_handover(handover_request_id(response, attempt)) == (response, attempt)


def test_attempt_zero_is_the_request_itself():
    assert handover_request_id("cmpl-a-0", 0) == "cmpl-a-0"
    assert split_handover("cmpl-a-0") == ("cmpl-a-0", 0)


def test_nested_ids_peel_off_from_the_outside_in():
    """Child 3 of choice 1 of the second attempt of prompt 2 of a response."""
    response = new_response_id("cmpl")
    prompt = prompt_request_id(response, 2)
    attempt = handover_request_id(prompt, 2)
    choice = choice_request_id(attempt, 1)
    child = child_request_id(choice, 3)
    assert child == f"3_{response}-2~handover2-1"
    parent, index = split_child(child)
    assert (parent, index) == (choice, 3)
    assert split_indexed(parent) == (attempt, 1)
    assert split_handover(attempt) == (prompt, 2)
    assert split_indexed(prompt) == (response, 2)


@pytest.mark.parametrize("split, request_id", [(split_indexed, "cmpl-abc"), (split_indexed, "7"), (split_child, "cmpl-abc-0"), (split_child, "_x")])
def test_an_id_of_another_shape_is_refused_by_name(split, request_id):
    with pytest.raises(ValueError, match=re.escape(repr(request_id))):
        split(request_id)
