"""Structured outputs: grammars (JSON schema, regex, choice, EBNF/Lark, structural tags) that
constrain what a request may generate.

The engine core owns the grammar state, beside the scheduler: `StructuredOutputManager` compiles
grammars in a thread pool (an LRU cache shares them between requests), each constrained request
holds a `RequestGrammar` (its matcher), and every step the manager fills one packed bitmask row
per constrained request that samples. The worker applies the rows to the logits before sampling
(workers/grammar_mask.py); the scheduler then advances each matcher with the sampled token.

A matcher's state is a function of its grammar and the request's output tokens: wherever a
request is rebuilt from its tokens (a resumed or handed-over request), the matcher replays them.
"""

from pagedserve.engine.structured_outputs.manager import StructuredOutputManager
from pagedserve.engine.structured_outputs.request_grammar import RequestGrammar
from pagedserve.engine.structured_outputs.validation import resolve_backend_name, validate_structured_outputs

__all__ = ["RequestGrammar", "StructuredOutputManager", "resolve_backend_name", "validate_structured_outputs"]
