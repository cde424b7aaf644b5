"""The worker's side of structured outputs: packed bitmask rows laid over the logits of the
constrained rows only (by the native kernel on the CPU, by torch from the unpacked rows
elsewhere, with the same result), padding columns never allowed, and a grammar that allows only
the stop tokens min_tokens bans still gets one of them."""

from __future__ import annotations

import numpy as np
import torch

import pytest

from pagedserve.kernels import native_build
from pagedserve.workers import grammar_mask
from pagedserve.workers.grammar_mask import apply_grammar, mask_unpacked, unpack_bitmask
from pagedserve.workers.sampler import Sampler, SamplingBatch


def pack(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """Rows of allowed ids as the engine sends them: int32 words, bit i of word i // 32."""
    words = np.zeros((len(allowed), (vocab + 31) // 32), dtype=np.uint32)
    for row, token_ids in enumerate(allowed):
        for t in token_ids:
            words[row, t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(words.view(np.int32))


def test_unpack_reads_bit_i_of_word_i_div_32():
    allowed = [[0, 31, 32, 63, 70], [5]]
    unpacked = unpack_bitmask(pack(allowed, 96))
    assert unpacked.shape == (2, 96)
    for row, token_ids in enumerate(allowed):
        assert unpacked[row].nonzero().flatten().tolist() == token_ids


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    """Each test below runs on both paths of apply_grammar."""
    if request.param == "native":
        assert native_build.load(), "the native kernels did not build"
    else:
        monkeypatch.setattr(grammar_mask, "_native_takes", lambda logits, rows: False)
    return request.param


def test_only_constrained_rows_are_masked_and_wider_logits_never_allowed(path):
    logits = torch.randn(3, 100)
    original = logits.clone()
    bitmask = pack([[3, 7], [64, 95]], 96)  # 96 columns: 96..99 are past the bitmask
    apply_grammar(logits, torch.tensor([0, 2]), bitmask)
    assert torch.equal(logits[1], original[1])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [3, 7]
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [64, 95]


def test_sampler_argmax_stays_inside_the_grammar_and_grammar_beats_min_tokens_ban(path):
    vocab, eos = 64, 2
    logits = torch.zeros(3, vocab)
    logits[:, 10] = 5.0  # every row's favourite, allowed only in the unconstrained row
    batch = SamplingBatch(temperature=torch.zeros(3), all_greedy=True,
                          banned_tokens={1: [eos], 2: [eos]},  # rows 1 and 2 below min_tokens
                          grammar_rows=torch.tensor([0, 1]),
                          grammar_bitmask=pack([[20, 21], [eos]], vocab))
    logits[0, 21] = 1.0
    sampled = Sampler(0, torch.device("cpu"))(logits, batch).sampled_token_ids.tolist()
    # Row 0: the best allowed token; row 1: its grammar allows only EOS, which wins over the
    # ban; row 2 (unconstrained) keeps its argmax.
    assert sampled == [21, eos, 10]


def test_every_row_constrained_masks_in_place_and_the_callers_logits_stay_untouched(path):
    """All rows under a grammar take torch's in-place path; the result equals the gather/scatter
    one, and the sampler never writes into the logits it was given (float32 or bf16)."""
    bitmask = pack([[3, 7], [64], [0, 95]], 96)
    every = torch.randn(3, 100)
    some = every.clone()
    apply_grammar(every, torch.tensor([0, 1, 2]), bitmask)
    for row in range(3):
        apply_grammar(some, torch.tensor([row]), bitmask[row : row + 1])
    assert torch.equal(every, some)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(3, 96).to(dtype)
        original = logits.clone()
        batch = SamplingBatch(temperature=torch.zeros(3), all_greedy=True, grammar_rows=torch.tensor([0, 1, 2]), grammar_bitmask=bitmask)
        assert Sampler(0, torch.device("cpu"))(logits, batch).sampled_token_ids.tolist() == [
            3 if logits[0, 3] > logits[0, 7] else 7, 64, 0 if logits[2, 0] > logits[2, 95] else 95]
        assert torch.equal(logits, original)


def test_grammar_rows_go_to_the_sampler_in_row_order():
    """The engine lists a step's constrained requests in its own order; the worker sorts them by
    batch row, each with its own bitmask row, so an all-constrained batch masks in place."""
    from types import SimpleNamespace

    from pagedserve.workers.sampling_batch import with_grammar

    vocab = 64
    states = [SimpleNamespace(req_id=name) for name in ("a", "b", "c")]
    step = SimpleNamespace(grammar_req_ids=["c", "a", "b"], grammar_bitmask=pack([[30], [10], [20]], vocab).numpy())
    batch = SamplingBatch(temperature=torch.zeros(3), all_greedy=True)
    constrained = with_grammar(batch, step, states, torch.device("cpu"))
    assert constrained.grammar_rows.tolist() == [0, 1, 2]
    assert [row.nonzero().flatten().tolist() for row in unpack_bitmask(constrained.grammar_bitmask)] == [[10], [20], [30]]
    assert Sampler(0, torch.device("cpu"))(torch.zeros(3, vocab), constrained).sampled_token_ids.tolist() == [10, 20, 30]


@pytest.mark.parametrize(("vocab", "words"), [(49152, 1536), (100, 3), (90, 3), (1000, 40)])
def test_the_native_kernel_masks_as_torch_does(vocab, words):
    """Random words (with all-allowed, all-forbidden and partial ones), a subset of the rows out of
    order, logits narrower and wider than the bitmask: the kernel's logits equal torch's."""
    assert native_build.load(), "the native kernels did not build"
    generator = torch.Generator().manual_seed(vocab)
    rows = torch.tensor([5, 0, 3, 6])
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), dtype=torch.int32, generator=generator)
    bitmask[0, :2], bitmask[1, :2], bitmask[2, 0] = -1, 0, -(2**31)  # all allowed, none, only the top bit
    logits = torch.randn(8, vocab, generator=generator)
    native, reference = logits.clone(), logits.clone()
    apply_grammar(native, rows, bitmask)
    mask_unpacked(reference, rows, unpack_bitmask(bitmask))
    assert torch.equal(native, reference)
    assert torch.equal(native[[1, 2, 4, 7]], logits[[1, 2, 4, 7]])  # unconstrained rows untouched


def test_the_native_kernel_refuses_a_row_outside_the_batch_and_writes_nothing():
    assert native_build.load(), "the native kernels did not build"
    logits = torch.randn(2, 64)
    original = logits.clone()
    with pytest.raises(RuntimeError, match="row 2 is outside the batch of 2"):
        torch.ops.pagedserve_cpu.grammar_mask(logits, torch.tensor([0, 2]), pack([[1], [2]], 64))
    assert torch.equal(logits, original)
