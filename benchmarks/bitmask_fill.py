"""The grammar bitmask's cost per step: rows filled one Python call at a time against the batched
fill the engine uses (StructuredOutputManager.fill_bitmask), for each backend, with the JSON
matchers spread over different positions in the object.

    python benchmarks/bitmask_fill.py                       # the demo's SmolLM2 tokenizer (49152 tokens)
    python benchmarks/bitmask_fill.py --model FOLDER --rows 8,64,256 --output fill.json
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info, write_report  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"],
}


def advanced_grammars(manager, tokenizer, count: int) -> list:
    """`count` matchers of SCHEMA, the i-th moved i % 12 random allowed tokens into the object."""
    from pagedserve.sampling_params import StructuredOutputsParams

    grammars = []
    for i in range(count):
        grammar = manager.grammar_for(StructuredOutputsParams(json=SCHEMA))
        grammar.future.result()
        grammar.poll([], time.monotonic())
        rng = random.Random(i)
        for _ in range(i % 12):
            bits = np.unpackbits(manager.fill_bitmask([grammar])[0].view(np.uint8), bitorder="little")
            choices = [int(t) for t in np.flatnonzero(bits) if t not in manager.stop_token_ids]
            if not choices:
                break
            grammar.accept(rng.choice(choices))
        grammars.append(grammar)
    return grammars


def per_step_ms(fill, repeats: int) -> float:
    fill()
    started = time.perf_counter()
    for _ in range(repeats):
        fill()
    return round((time.perf_counter() - started) / repeats * 1e3, 4)


def measure(backend: str, tokenizer, rows: list[int], repeats: int) -> dict:
    from pagedserve.engine.structured_outputs.backend import GrammarMatcher
    from pagedserve.engine.structured_outputs.manager import StructuredOutputManager

    manager = StructuredOutputManager(lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id], backend=backend)
    grammars = advanced_grammars(manager, tokenizer, max(rows))
    result = {}
    for n in rows:
        subset = grammars[:n]

        def one_at_a_time():
            bitmask = torch.full((n, manager.num_bitmask_words), -1, dtype=torch.int32)
            GrammarMatcher.fill_rows.__func__(GrammarMatcher, [g.matcher for g in subset], bitmask, list(range(n)))

        result[n] = {
            "one_at_a_time_ms": per_step_ms(one_at_a_time, repeats),
            "batched_ms": per_step_ms(lambda: manager.fill_bitmask(subset), repeats),
        }
        print(backend, n, result[n], file=sys.stderr, flush=True)
    manager.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a folder with the tokenizer (default: the demo model's)")
    parser.add_argument("--rows", default="8,64")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from pagedserve.demo import ensure_demo_model

    model = args.model or str(ensure_demo_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [int(n) for n in args.rows.split(",")]
    report = {"machine": machine_info(), "model": model, "vocab": len(tokenizer)}
    report["fill"] = {backend: measure(backend, tokenizer, rows, args.repeats) for backend in ("xgrammar", "guidance")}
    write_report(report, args.output)


if __name__ == "__main__":
    main()
