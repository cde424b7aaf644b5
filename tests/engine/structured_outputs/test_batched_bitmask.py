"""The step's bitmask is filled in one batched call per grammar library (xgrammar's
BatchGrammarMatcher, llguidance's parallel executor). Each row must equal what that request's
matcher writes alone, whatever state each matcher is in, and padding columns stay masked."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch

from pagedserve.engine.structured_outputs.manager import StructuredOutputManager
from pagedserve.sampling_params import StructuredOutputsParams
from tests.engine.structured_outputs.conftest import SPECS

PADDED_VOCAB = 544  # the tiny tokenizer has 512 entries: 32 padding columns the grammar never allows


def allowed(row: np.ndarray) -> list[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits).tolist()


def ready_grammars(manager: StructuredOutputManager, rng: random.Random) -> list:
    """Two grammars of every kind; each advanced by a different number of allowed tokens."""
    grammars = []
    for steps, (kind, spec) in enumerate(list(SPECS.items()) * 2):
        grammar = manager.grammar_for(StructuredOutputsParams(**{kind: spec}))
        grammar.future.result(timeout=60)
        assert grammar.poll([], time.monotonic()), grammar.error
        for _ in range(steps):
            row = manager.fill_bitmask([grammar])[0]
            choices = [t for t in allowed(row) if t not in manager.stop_token_ids]
            if not choices:
                break
            assert grammar.accept(rng.choice(choices))
        grammars.append(grammar)
    return grammars


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_batched_fill_equals_each_matcher_alone(tokenizer, backend):
    manager = StructuredOutputManager(lambda: tokenizer, PADDED_VOCAB, [tokenizer.eos_token_id], backend=backend)
    try:
        grammars = ready_grammars(manager, random.Random(0))
        batched = manager.fill_bitmask(grammars)
        for row, grammar in enumerate(grammars):
            alone = torch.full((1, manager.num_bitmask_words), -1, dtype=torch.int32)
            grammar.matcher.fill_bitmask(alone, 0)
            assert np.array_equal(batched[row], alone.numpy()[0]), f"row {row} ({grammar.kind})"
            tokens = allowed(batched[row])
            assert tokens, f"row {row} ({grammar.kind}) allows nothing"
            assert max(tokens) < len(tokenizer), "a padding column was allowed"
        # The rows differ: the batch did not write one matcher's mask everywhere.
        assert len({batched[row].tobytes() for row in range(len(grammars))}) > len(SPECS)
    finally:
        manager.shutdown()
