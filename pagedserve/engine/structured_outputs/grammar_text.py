"""Small text helpers shared by the backends: choices as EBNF, and telling Lark from EBNF."""

from __future__ import annotations

import json
import re

# An EBNF/GBNF rule is `name ::= ...`; a Lark rule is `name: ...` (or `?name:` / `name.2:`).
_EBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.MULTILINE)
_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][\w]*(\.\d+)?\s*:(?!:)", re.MULTILINE)


def choice_to_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b"`: each choice a JSON-escaped string literal (xgrammar's EBNF reads
    the same escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def is_lark(grammar: str) -> bool:
    """A grammar with Lark rules and no EBNF `::=` rule (vLLM accepts both kinds)."""
    return not _EBNF_RULE.search(grammar) and bool(_LARK_RULE.search(grammar))
