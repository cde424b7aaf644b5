"""Multi-LoRA on Ray workers stays exact: with tensor parallelism each rank loads only its shard
of A and B (column-parallel B rows, row-parallel A columns, split as the base layer splits), with
pipeline parallelism each stage only its own layers' adapters."""

from __future__ import annotations

import pytest

from pagedserve import LLM
from tests.e2e.test_hf_exactness import PROMPTS
from tests.lora.test_lora_exactness import run_and_check


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_mixed_batch_on_ray_matches_peft_merged(ray_cluster, tp, pp, model_dirs, lora_adapters, lora_references):
    llm = LLM(str(model_dirs["qwen2"]), dtype="float32", max_model_len=256, enable_lora=True, max_loras=3,
              tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        run_and_check(llm, "qwen2", lora_adapters["qwen2"], lora_references, PROMPTS[:3])
    finally:
        llm.shutdown()
