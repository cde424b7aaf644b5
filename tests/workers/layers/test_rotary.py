"""workers/layers/rotary.py: the RoPE parameters read from either config style, the inverse
frequencies against the formula and Hugging Face's own functions, and the rotation against a
direct formula (each pair (x_i, x_{i+d/2}) turned by position * inv_freq_i)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedserve.workers.layers.rotary import RotaryEmbedding, inverse_frequencies, rope_parameters

LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)


def test_rope_parameters_from_either_config_style():
    new_style = SimpleNamespace(rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0})
    assert rope_parameters(new_style) == {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}
    old_style = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 4.0})
    params = rope_parameters(old_style)
    assert (params["rope_type"], params["rope_theta"], params["factor"]) == ("linear", 5e5, 4.0)
    assert rope_parameters(SimpleNamespace()) == {"rope_theta": 10000.0, "rope_type": "default"}


def test_an_unsupported_scaling_names_itself_and_the_supported_ones():
    with pytest.raises(ValueError, match=r"unsupported RoPE scaling type 'yarn'; supported: default, linear, llama3"):
        rope_parameters(SimpleNamespace(rope_scaling={"rope_type": "yarn", "factor": 2.0}))


def test_default_and_linear_frequencies_follow_the_formula():
    head_dim, theta = 16, 10000.0
    expected = torch.tensor([1.0 / theta ** (2 * i / head_dim) for i in range(head_dim // 2)])
    default = inverse_frequencies(head_dim, {"rope_type": "default", "rope_theta": theta})
    torch.testing.assert_close(default, expected, rtol=1e-6, atol=0)
    linear = inverse_frequencies(head_dim, {"rope_type": "linear", "rope_theta": theta, "factor": 4.0})
    torch.testing.assert_close(linear, expected / 4.0, rtol=1e-6, atol=0)


@pytest.mark.parametrize("params", [dict(rope_type="linear", rope_theta=10000.0, factor=3.0), LLAMA3], ids=["linear", "llama3"])
def test_scaled_frequencies_equal_hugging_face(params):
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, rope_parameters=dict(params))
    theirs, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    assert torch.equal(inverse_frequencies(64, dict(params)), theirs)


def test_rotation_against_the_direct_formula():
    head_dim, num_heads, num_kv_heads = 8, 3, 1
    rope = RotaryEmbedding(head_dim, max_positions=64, params={"rope_type": "default", "rope_theta": 100.0})
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 7, 63])
    query = torch.randn(4, num_heads, head_dim, generator=gen)
    key = torch.randn(4, num_kv_heads, head_dim, generator=gen)
    rotated_query, rotated_key = rope(positions, query, key)

    def direct(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        half = head_dim // 2
        for t, position in enumerate(positions.tolist()):
            for i in range(half):
                angle = position * 100.0 ** (-2 * i / head_dim)
                a, b = x[t, :, i], x[t, :, i + half]
                out[t, :, i] = a * math.cos(angle) - b * math.sin(angle)
                out[t, :, i + half] = b * math.cos(angle) + a * math.sin(angle)
        return out

    torch.testing.assert_close(rotated_query, direct(query), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotated_key, direct(key), rtol=1e-5, atol=1e-5)
    assert torch.equal(rotated_query[0], query[0])  # position 0 is not turned


def test_rotation_keeps_relative_positions():
    """q.k after RoPE depends only on the distance between the two positions."""
    rope = RotaryEmbedding(16, max_positions=128, params={"rope_type": "default", "rope_theta": 10000.0})
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 16, generator=gen), torch.randn(1, 1, 16, generator=gen)

    def score(q_position: int, k_position: int) -> float:
        rq, _ = rope(torch.tensor([q_position]), q, k)
        _, rk = rope(torch.tensor([k_position]), q, k)
        return float((rq * rk).sum())

    assert score(10, 3) == pytest.approx(score(57, 50), rel=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), rel=1e-4)
