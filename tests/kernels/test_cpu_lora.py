"""The native LoRA kernel (csrc/cpu_lora.cpp): a step's rows of several adapters, each row plus
(x A^T) B^T of its own adapter, against float64; a row's result does not depend on its batch."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.is_available(), reason="the native CPU kernels did not build (no g++?)")

IN, OUT = 96, 72


def adapters(ranks: list[int], seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    a_t = [torch.randn(IN, r, generator=gen) * 0.1 for r in ranks]
    b_t = [torch.randn(r, OUT, generator=gen) * 0.1 for r in ranks]
    return a_t, b_t


def lora_add(out, x, slots, a_t, b_t) -> torch.Tensor:
    out = out.clone()
    torch.ops.pagedserve_cpu.lora_add(out, x, torch.tensor(slots, dtype=torch.long), a_t, b_t)
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


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda args: args.update(slots=[0, 2]), "names adapter 2"),
        (lambda args: args.update(x=args["x"].float()), "of one dtype"),
        (lambda args: args.update(a_t=[args["a_t"][0].double(), args["a_t"][1]]), "float32"),
        (lambda args: args.update(b_t=[args["b_t"][1], args["b_t"][0]]), "adapter 0 has"),
    ],
)
def test_bad_arguments_are_refused(change, message):
    a_t, b_t = adapters([8, 16])
    args = {"out": torch.zeros(2, OUT, dtype=torch.bfloat16), "x": torch.zeros(2, IN, dtype=torch.bfloat16), "slots": [0, 1], "a_t": a_t, "b_t": b_t}
    change(args)
    with pytest.raises(RuntimeError, match=message):
        lora_add(args["out"], args["x"], args["slots"], args["a_t"], args["b_t"])
