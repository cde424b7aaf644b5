"""Fixtures and specs shared by the structured-output tests."""

from __future__ import annotations

import pytest

from tests.engine.structured_outputs.grammar_reference import GrammarReference

# Bounded fields, so even a random-weight model completes the object within a few dozen tokens.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},  # (xgrammar lets maxLength strings hold raw control characters)
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "ok", "role"],
    "additionalProperties": False,  # llguidance leaves objects open unless told (xgrammar closes them)
}
REGEX = r"[a-z]{3}-[0-9]{2}"  # (llguidance reads \\d as any Unicode digit)
CHOICES = ["yes", "no", "maybe so"]
EBNF = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
# kind -> value, as StructuredOutputsParams takes them
SPECS = {"json": PERSON_SCHEMA, "regex": REGEX, "choice": CHOICES, "grammar": EBNF}


@pytest.fixture(scope="session")
def grammar_references(model_dirs) -> dict[str, GrammarReference]:
    return {name: GrammarReference(folder) for name, folder in model_dirs.items()}
