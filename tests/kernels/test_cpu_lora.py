"""The native LoRA kernel (csrc/cpu_lora.cpp): a step's rows of several adapters, each row plus
(x A^T) B^T of its own adapter, against float64; a row's result does not depend on its batch."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_native
from pagedserve.workers.lora.layer_lora import AdapterWeights


@pytest.fixture(scope="module", autouse=True)
def built():
    """As test_cpu_native: the kernels build wherever the tests run (g++ and torch's headers)."""
    assert cpu_native.is_available(), "the native CPU kernels did not build (g++ and torch's headers are needed)"


IN, OUT = 96, 72  # 72: four and a half segments of sixteen output columns


def adapters(ranks: list[int], seed: int = 0) -> list[AdapterWeights]:
    """Adapters with one projection over all of out's columns (a dense B^T [r, OUT])."""
    gen = torch.Generator().manual_seed(seed)
    built = []
    for r in ranks:
        a_t, b_t = torch.randn(IN, r, generator=gen) * 0.1, torch.randn(r, OUT, generator=gen) * 0.1
        built.append(AdapterWeights.build(a_t, [(0, b_t)] if r else []))
    return built


def dense_b_t(weights: AdapterWeights) -> torch.Tensor:
    """B^T [r_total, OUT] with each projection's block where it acts, zeros elsewhere."""
    dense = torch.zeros(weights.a_t.shape[1], OUT)
    for index, (column, width, first, rank, _) in enumerate(weights.parts):
        dense[first : first + rank, column : column + width] = weights.b_t(index)
    return dense


def lora_add(out, x, slots, weights: list[AdapterWeights], segments=None) -> torch.Tensor:
    out = out.clone()
    segments = [w.segments for w in weights] if segments is None else segments
    torch.ops.pagedserve_cpu.lora_add(out, x, torch.tensor(slots, dtype=torch.long), [w.a_t for w in weights], [w.b for w in weights], segments)
    return out


def assert_within_one_rounding(got, out, x, slots, weights):
    eps, eps32 = torch.finfo(got.dtype).eps / 2, torch.finfo(torch.float32).eps
    for row, slot in enumerate(slots):
        if slot < 0:
            assert torch.equal(got[row], out[row]), "a row without an adapter changed"
            continue
        a64, b64 = weights[slot].a_t.double(), dense_b_t(weights[slot]).double()
        exact = out[row].double() + (x[row].double() @ a64) @ b64
        magnitude = out[row].double().abs() + (x[row].double().abs() @ a64.abs()) @ b64.abs()
        # float32 sums over `in` and the rank, then one rounding to the dtype.
        bound = eps * exact.abs() + 2 * (IN + a64.shape[1]) * eps32 * magnitude
        assert ((got[row].double() - exact).abs() <= bound).all(), f"row {row} (adapter {slot})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows", [1, 7, 8, 9, 40])
def test_each_row_gets_its_adapters_product_within_one_rounding(dtype, num_rows):
    """Ranks 8, 24 and 0 (an adapter the layer lacks); rows of no adapter (-1) are untouched.
    More than 8 rows of one adapter span several blocks."""
    gen = torch.Generator().manual_seed(num_rows)
    weights = adapters([8, 24, 0])
    x = torch.randn(num_rows, IN, generator=gen).to(dtype)
    out = torch.randn(num_rows, OUT, generator=gen).to(dtype)
    slots = torch.randint(-1, 3, (num_rows,), generator=gen).tolist()
    assert_within_one_rounding(lora_add(out, x, slots, weights), out, x, slots, weights)


def test_a_rows_result_does_not_depend_on_its_batch():
    weights = adapters([8, 16], seed=1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(13, IN, generator=gen).to(torch.bfloat16)
    out = torch.randn(13, OUT, generator=gen).to(torch.bfloat16)
    slots = [0, 1, 1, 0, -1, 0, 1, 0, 0, 0, 0, 0, 1]
    batched = lora_add(out, x, slots, weights)
    for row in range(13):
        alone = lora_add(out[row : row + 1], x[row : row + 1], [slots[row]], weights)
        assert torch.equal(batched[row : row + 1], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projections_of_a_fused_layer_each_take_their_own_columns(dtype):
    """A qkv-like layer: projection one (rank 8) on columns 0-39, none on 40-47 (a projection
    the adapter does not target), projection two (rank 5) on 48-71. Widths that are not
    multiples of sixteen end in short segments; the untargeted columns stay as they were."""
    gen = torch.Generator().manual_seed(3)
    a_t = torch.randn(IN, 13, generator=gen) * 0.1
    blocks = [(0, torch.randn(8, 40, generator=gen) * 0.1), (48, torch.randn(5, 24, generator=gen) * 0.1)]
    weights = AdapterWeights.build(a_t, blocks)
    assert weights.segments[:, :4].tolist() == [[0, 16, 0, 8], [16, 16, 0, 8], [32, 8, 0, 8], [48, 16, 8, 13], [64, 8, 8, 13]]
    assert weights.b.numel() == 8 * 40 + 5 * 24  # no zeros stored between the projections
    x = torch.randn(9, IN, generator=gen).to(dtype)
    out = torch.randn(9, OUT, generator=gen).to(dtype)
    slots = [0] * 9
    got = lora_add(out, x, slots, [weights])
    assert torch.equal(got[:, 40:48], out[:, 40:48])
    assert not torch.equal(got[:, :40], out[:, :40]) and not torch.equal(got[:, 48:], out[:, 48:])
    assert_within_one_rounding(got, out, x, slots, [weights])


def test_a_rank_zero_adapter_has_no_segments():
    weights = AdapterWeights.build(torch.empty(IN, 0), [])
    assert weights.segments.shape == (0, 6) and weights.b.numel() == 0


def segments_with(weights: AdapterWeights, row: int, column: int, value: int) -> list[torch.Tensor]:
    changed = weights.segments.clone()
    changed[row, column] = value
    return [changed, adapters([16])[0].segments]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda args: args.update(slots=[0, 2]), "names adapter 2"),
        (lambda args: args.update(x=args["x"].float()), "of one dtype"),
        (lambda args: args.update(a_t=[args["a_t"][0].double(), args["a_t"][1]]), "float32"),
        (lambda args: args.update(a_t=[args["a_t"][1][:-1], args["a_t"][1]]), "for x with 96 columns"),
        (lambda args: args.update(segments=[torch.zeros(2, 5, dtype=torch.long), args["segments"][1]]), r"int64 \[S, 6\]"),
        (lambda args: args.update(segments=segments_with(args["weights"][0], 4, 0, 70)), "outside out's 72 columns"),
        (lambda args: args.update(segments=segments_with(args["weights"][0], 0, 1, 17)), "outside out's 72 columns"),
        (lambda args: args.update(segments=segments_with(args["weights"][0], 0, 3, 9)), "outside its rank"),
        (lambda args: args.update(segments=segments_with(args["weights"][0], 0, 3, 0)), "outside its rank"),
        (lambda args: args.update(segments=segments_with(args["weights"][0], 4, 4, 70)), "reads past its B"),
        (lambda args: args.update(x=args["x"][:, :0], a_t=[a[:0] for a in args["a_t"]]), "at least one column"),
    ],
)
def test_bad_arguments_are_refused(change, message):
    weights = adapters([8, 16])
    args = {"out": torch.zeros(2, OUT, dtype=torch.bfloat16), "x": torch.zeros(2, IN, dtype=torch.bfloat16), "slots": [0, 1], "weights": weights}
    args.update(a_t=[w.a_t for w in weights], b=[w.b for w in weights], segments=[w.segments for w in weights])
    change(args)
    out = args["out"].clone()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pagedserve_cpu.lora_add(out, args["x"], torch.tensor(args["slots"]), args["a_t"], args["b"], args["segments"])
