"""Per-token cost of stop strings in the detokenizer, the scenario of issue 19 (200k stop strings
cost 50 ms per token and stalled every stream of a replica). Prints JSON.

Streams `--tokens` tokens of plain text through IncrementalDetokenizer with a list of stop
strings that never occur, and times the last `--timed` updates (so the text generated before
them is long). The stop lists are set after SamplingParams' checks, so the same script measures
lists past today's caps, and an older checkout (run it with PYTHONPATH pointing there) too:

    PYTHONPATH=$PWD python benchmarks/stop_strings.py
    PYTHONPATH=/path/to/old/checkout python benchmarks/stop_strings.py
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.sampling_params import SamplingParams
from pagedserve.tiny_model import build_tokenizer

TEXT = "the quick brown fox jumps over the lazy dog. " * 400
CASES = {  # name -> (number of stop strings, characters each)
    "16x256": (16, 256),  # the most the caps allow
    "16x8": (16, 8),
    "1000x8": (1000, 8),
    "200000x8": (200_000, 8),  # the scenario (now refused by SamplingParams and over HTTP)
}


def stop_list(count: int, length: int) -> list[str]:
    # Distinct CJK strings: the English text never holds one, so no request ends early.
    return [(chr(0x4E00 + i % 20000) + chr(0x4E00 + i // 20000)) * (length // 2) for i in range(count)]


def per_token_ms(tokenizer, token_ids: list[int], stop: list[str], num_timed: int) -> float:
    params = SamplingParams().clone(stop=stop)  # clone: past the caps, as the old code took them
    detok = IncrementalDetokenizer(tokenizer, len(tokenizer), token_ids[:5], params)
    warm, timed = token_ids[: -num_timed], token_ids[-num_timed:]
    for token_id in warm:
        detok.update([token_id], False)
    start = time.perf_counter()
    for token_id in timed:
        assert detok.update([token_id], False) is None
    return (time.perf_counter() - start) / num_timed * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000, help="tokens streamed per case")
    parser.add_argument("--timed", type=int, default=50, help="of which the last ones are timed")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    args = parser.parse_args()
    cases = {name: CASES[name] for name in args.cases.split(",")}
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = build_tokenizer(Path(folder))
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)[: args.tokens]
    baseline = per_token_ms(tokenizer, token_ids, [], args.timed)
    results = {name: per_token_ms(tokenizer, token_ids, stop_list(*shape), args.timed) for name, shape in cases.items()}
    print(json.dumps({
        "tokens": len(token_ids), "timed": args.timed, "no_stop_ms_per_token": round(baseline, 4),
        "ms_per_token": {name: round(ms, 4) for name, ms in results.items()},
    }, indent=2))


if __name__ == "__main__":
    main()
