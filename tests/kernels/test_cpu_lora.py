"""The native LoRA kernel (csrc/cpu_lora.cpp): a step's rows of several adapters, each row plus
(x A^T) B^T of its own adapter, against float64; a row's result does not depend on its batch."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_native
from pagedserve.workers.lora.layer_lora import kernel_ranges


@pytest.fixture(scope="module", autouse=True)
def built():
    """As test_cpu_native: the kernels build wherever the tests run (g++ and torch's headers)."""
    assert cpu_native.is_available(), "the native CPU kernels did not build (g++ and torch's headers are needed)"


IN, OUT = 96, 72  # 72: four and a half chunks of sixteen output columns


def adapters(ranks: list[int], seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    a_t = [torch.randn(IN, r, generator=gen) * 0.1 for r in ranks]
    b_t = [torch.randn(r, OUT, generator=gen) * 0.1 for r in ranks]
    return a_t, b_t


def lora_add(out, x, slots, a_t, b_t, k_ranges=None) -> torch.Tensor:
    out = out.clone()
    k_ranges = [kernel_ranges(b) for b in b_t] if k_ranges is None else k_ranges
    torch.ops.pagedserve_cpu.lora_add(out, x, torch.tensor(slots, dtype=torch.long), a_t, b_t, k_ranges)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows", [1, 7, 8, 9, 40])
def test_each_row_gets_its_adapters_product_within_one_rounding(dtype, num_rows):
    """Ranks 8, 24 and 0 (an adapter the layer lacks); rows of no adapter (-1) are untouched.
    More than 8 rows of one adapter span several blocks."""
    gen = torch.Generator().manual_seed(num_rows)
    a_t, b_t = adapters([8, 24, 0])
    x = torch.randn(num_rows, IN, generator=gen).to(dtype)
    out = torch.randn(num_rows, OUT, generator=gen).to(dtype)
    slots = torch.randint(-1, 3, (num_rows,), generator=gen).tolist()
    got = lora_add(out, x, slots, a_t, b_t)
    eps, eps32 = torch.finfo(dtype).eps / 2, torch.finfo(torch.float32).eps
    for row, slot in enumerate(slots):
        if slot < 0:
            assert torch.equal(got[row], out[row]), "a row without an adapter changed"
            continue
        a64, b64 = a_t[slot].double(), b_t[slot].double()
        exact = out[row].double() + (x[row].double() @ a64) @ b64
        magnitude = out[row].double().abs() + (x[row].double().abs() @ a64.abs()) @ b64.abs()
        # float32 sums over `in` and the rank, then one rounding to the dtype.
        bound = eps * exact.abs() + 2 * (IN + a64.shape[1]) * eps32 * magnitude
        assert ((got[row].double() - exact).abs() <= bound).all(), f"row {row} (adapter {slot})"


def test_a_rows_result_does_not_depend_on_its_batch():
    a_t, b_t = adapters([8, 16], seed=1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(13, IN, generator=gen).to(torch.bfloat16)
    out = torch.randn(13, OUT, generator=gen).to(torch.bfloat16)
    slots = [0, 1, 1, 0, -1, 0, 1, 0, 0, 0, 0, 0, 1]
    batched = lora_add(out, x, slots, a_t, b_t)
    for row in range(13):
        alone = lora_add(out[row : row + 1], x[row : row + 1], [slots[row]], a_t, b_t)
        assert torch.equal(batched[row : row + 1], alone)


def test_a_block_diagonal_b_skips_its_zero_blocks_and_sums_the_same():
    """A fused qkv-like B^T: rank rows 0-7 feed columns 0-47, rows 8-15 columns 48-71. The
    ranges skip the zero blocks; the result equals the full product's bit for bit."""
    a_t, b_t = adapters([16], seed=3)
    b_t[0][:8, 48:] = 0
    b_t[0][8:, :48] = 0
    ranges = kernel_ranges(b_t[0])
    assert ranges.tolist() == [[0, 8], [0, 8], [0, 8], [8, 16], [8, 16]]
    full = torch.tensor([[0, 16]] * 5)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, IN, generator=gen).to(torch.bfloat16)
    out = torch.randn(9, OUT, generator=gen).to(torch.bfloat16)
    skipped = lora_add(out, x, [0] * 9, a_t, b_t, [ranges])
    assert torch.equal(skipped, lora_add(out, x, [0] * 9, a_t, b_t, [full]))
    assert not torch.equal(skipped, out)


def test_kernel_ranges_of_an_empty_chunk_and_a_rank_zero_adapter():
    b_t = torch.zeros(4, 40)
    b_t[2, 5] = 1.0
    assert kernel_ranges(b_t).tolist() == [[2, 3], [0, 0], [0, 0]]
    assert kernel_ranges(torch.empty(0, 20)).tolist() == [[0, 0], [0, 0]]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda args: args.update(slots=[0, 2]), "names adapter 2"),
        (lambda args: args.update(x=args["x"].float()), "of one dtype"),
        (lambda args: args.update(a_t=[args["a_t"][0].double(), args["a_t"][1]]), "float32"),
        (lambda args: args.update(b_t=[args["b_t"][1], args["b_t"][0]]), "adapter 0 has"),
        (lambda args: args.update(k_ranges=[torch.tensor([[0, 9]] * 5), kernel_ranges(args["b_t"][1])]), "outside its rank"),
        (lambda args: args.update(k_ranges=[torch.zeros(4, 2, dtype=torch.long), kernel_ranges(args["b_t"][1])]), r"int64 \[5, 2\]"),
        (lambda args: args.update(x=args["x"][:, :0], a_t=[a[:0] for a in args["a_t"]]), "at least one column"),
    ],
)
def test_bad_arguments_are_refused(change, message):
    a_t, b_t = adapters([8, 16])
    args = {"out": torch.zeros(2, OUT, dtype=torch.bfloat16), "x": torch.zeros(2, IN, dtype=torch.bfloat16), "slots": [0, 1], "a_t": a_t, "b_t": b_t}
    args["k_ranges"] = [kernel_ranges(b) for b in b_t]
    change(args)
    with pytest.raises(RuntimeError, match=message):
        lora_add(args["out"], args["x"], args["slots"], args["a_t"], args["b_t"], args["k_ranges"])
