"""Compile the Triton kernels ahead of time for NVIDIA GPUs, without one: Triton's CUDA backend
and ptxas ship with the triton wheel. The interpreter accepts code that the compiler rejects
(types of loop variables, dot shapes, constexpr misuse); this catches that on a CPU-only machine.

Run as `python -m tests.kernels.compile_for_gpu` without TRITON_INTERPRET (a test does so).
"""

from __future__ import annotations

import os

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

assert not os.environ.get("TRITON_INTERPRET"), "compiling needs the real JIT functions"

from pagedserve.kernels import triton_attention, triton_cache, triton_layers  # noqa: E402

# (dtype, head_dim, group, block_m, num_splits, block_size, sm): decode with splits, prefill
# tiles, float32 (IEEE dots), a non-power-of-two head and group.
ATTENTION_CONFIGS = [
    ("bf16", 128, 4, 16, 16, 16, 90),
    ("bf16", 64, 4, 64, 1, 16, 90),
    ("fp32", 64, 2, 64, 1, 8, 80),
    ("fp16", 96, 3, 64, 1, 128, 80),
]


def compile_kernel(fn, types: dict[str, str], constexprs: dict, sm: int):
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
    constants = {(fn.arg_names.index(name),): value for name, value in constexprs.items()}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants), target=GPUTarget("cuda", sm, 32))


def compile_attention(dtype: str, head_dim: int, group: int, block_m: int, num_splits: int, block_size: int, sm: int):
    types = {name: f"*{dtype}" for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    types |= {name: "*fp32" for name in ("part_acc_ptr", "part_max_ptr", "part_sum_ptr")}
    types |= {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "qk_scale": "fp32"}
    block_d = triton.next_power_of_2(head_dim)
    constexprs = dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_m // group,
        TILE_N=64 if block_d <= 128 else 32, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", UPCAST=False,
    )
    return compile_kernel(triton_attention._paged_attention_kernel, types, constexprs, sm)


def main() -> None:
    for config in ATTENTION_CONFIGS:
        compile_attention(*config)
        print("compiled paged attention", config)
    merge_types = {name: "*fp32" for name in ("part_acc_ptr", "part_max_ptr", "part_sum_ptr")} | {"out_ptr": "*bf16"}
    compile_kernel(triton_attention._merge_splits_kernel, merge_types, dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=16), 90)
    print("compiled split merge")
    write_types = {name: "*bf16" for name in ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")} | {"slot_ptr": "*i64"}
    compile_kernel(triton_cache._write_kv_kernel, write_types, dict(BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128), 90)
    print("compiled cache write")
    compile_layers()


def compile_layers() -> None:
    """The fused layers, in each dtype and at Llama-3.2-1B's and SmolLM2's sizes."""
    for dtype, sm in (("bf16", 90), ("fp32", 80), ("fp16", 80)):
        norm_types = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "eps": "fp32"}
        compile_kernel(triton_layers._rms_norm_kernel, norm_types, dict(BLOCK=2048), sm)
        rotary_types = {"x_ptr": f"*{dtype}", "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": f"*{dtype}"}
        compile_kernel(triton_layers._rotary_kernel, rotary_types, dict(HALF=32, BLOCK_H=32, BLOCK_HALF=32), sm)
        silu_types = {"x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"}
        compile_kernel(triton_layers._silu_and_mul_kernel, silu_types, dict(BLOCK=1024), sm)
        print("compiled fused layers", dtype)


if __name__ == "__main__":
    main()
