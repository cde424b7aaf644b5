"""Which implementation `attention_backend` picks, and the errors that say what to change."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (the test extra has it on x86-64 Linux only)")

import torch

from pagedserve.kernels import flash_attn, get_attention_backend, reference, triton_attention
from tests.kernels.conftest import DEVICE


def test_auto_is_native_on_cpu_and_triton_on_cuda():
    # Without a C++ compiler `auto` on the CPU is `cpu`/`torch`: tests/kernels/test_cpu_native.py.
    assert get_attention_backend("auto", "cpu", dtype=torch.bfloat16).name == "native"
    assert get_attention_backend("auto", "cpu", dtype=torch.float32).name == "native"
    assert get_attention_backend("auto", "cuda").name == "triton"
    assert get_attention_backend("cpu", "cpu").name == "cpu"  # the pure-torch fast path stays selectable
    assert get_attention_backend("torch", "cpu").name == "torch"  # the reference stays selectable


def test_cpu_backend_on_cuda_is_refused():
    with pytest.raises(ValueError, match="runs on the CPU only"):
        get_attention_backend("cpu", "cuda")


def test_triton_shares_the_reference_cache_layout():
    backend = get_attention_backend("triton", DEVICE)  # on the CPU the interpreter is on (conftest)
    assert backend.name == "triton"
    assert backend.kv_cache_shape(10, 16, 2, 64) == reference.kv_cache_shape(10, 16, 2, 64)
    assert backend.paged_attention is triton_attention.paged_attention


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(triton_attention, "IS_INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_attention_backend("triton", "cpu")


def test_flash_attn_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(flash_attn, "is_installed", lambda: False)
    with pytest.raises(ValueError, match=r"pip install 'pagedserve\[gpu\]'"):
        get_attention_backend("flash_attn", "cuda", block_size=256, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "block_size, dtype, device, message",
    [
        (16, torch.bfloat16, "cuda", "multiple of 256"),
        (256, torch.float32, "cuda", "float16 and bfloat16"),
        (256, torch.bfloat16, "cpu", "only on CUDA"),
    ],
)
def test_flash_attn_unsupported_configs(monkeypatch, block_size, dtype, device, message):
    monkeypatch.setattr(flash_attn, "is_installed", lambda: True)
    with pytest.raises(ValueError, match=message):
        get_attention_backend("flash_attn", device, block_size=block_size, dtype=dtype)


def test_flash_attn_layout(monkeypatch):
    monkeypatch.setattr(flash_attn, "is_installed", lambda: True)
    backend = get_attention_backend("flash_attn", "cuda", block_size=256, dtype=torch.float16)
    assert backend.kv_cache_shape(10, 256, 2, 64) == (2, 10, 256, 2, 64)


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown attention_backend"):
        get_attention_backend("xformers", "cpu")
