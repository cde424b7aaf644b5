"""How a forced tool call (tool_choice "required" or a named function) is written: in the model's
own format where the server's --tool-call-parser names one a grammar can write (hermes:
`<tool_call>\n{...}\n</tool_call>`, one block per call; llama3_json: `{"name": ..., "parameters":
{...}}`, several joined by "; "), else as plain JSON (a call object, or a list of them: mistral's
format after its special-token marker). Either way the call is valid by construction, and the same
format's parser reads it back.

A framed form is an EBNF grammar around xgrammar's own rendering of the call's JSON schema
(compact unless the request asks for free whitespace), so it needs the xgrammar backend (the
engine's default); a single llama3_json call is a JSON schema, which either backend takes.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Imported with this module, at the ingress's start, not at its first forced call: xgrammar
# imports transformers, whose lazy module is not thread-safe, and on a fresh ingress the first
# request's import raced the tokenizer's load on another thread ("cannot import name
# 'PreTrainedTokenizerBase' from 'transformers'": a 500).
import xgrammar as xgr

from pagedserve.cluster.structured_requests import FieldError
from pagedserve.cluster.tool_parsers import ToolParser
from pagedserve.cluster.tool_parsers.hermes import END, START, HermesToolParser
from pagedserve.cluster.tool_parsers.json_calls import JsonToolParser, Llama3JsonToolParser
from pagedserve.cluster.tool_requests import ForcedCall
from pagedserve.engine.structured_outputs.backend import COMPACT_SEPARATORS

# Parsers whose forced calls a grammar writes in the model's own format. mistral's marker is a
# special token, which no grammar can write: its forced calls are the JSON array that follows the
# marker (the model's format without it), read by the plain JSON parser.
FRAMED_FORMATS = ("hermes", "llama3_json")
LLAMA3_ARGUMENTS_KEY = "parameters"  # Llama 3.1's call object: {"name": ..., "parameters": {...}}


def forced_call_spec(forced: ForcedCall, tool_call_parser: str | None, compact: bool) -> dict[str, Any]:
    """The StructuredOutputsParams constraint (kind -> spec) of a forced call."""
    if tool_call_parser == "hermes":
        return {"grammar": framed_grammar(forced.call_schema, forced.is_list, compact, json.dumps(START + chr(10)), json.dumps(chr(10) + END), '"\\n"')}
    if tool_call_parser == "llama3_json":
        call_schema = renamed_arguments(forced.call_schema, LLAMA3_ARGUMENTS_KEY)
        if not forced.is_list:
            return {"json": call_schema}
        return {"grammar": framed_grammar(call_schema, True, compact, "", "", '"; "')}
    if tool_call_parser == "mistral":  # always an array after the marker, as the model writes it
        return {"json": {"type": "array", "items": forced.call_schema, "minItems": 1, **({} if forced.is_list else {"maxItems": 1})}}
    return {"json": forced.json_schema()}


def forced_call_parser(tool_call_parser: str | None) -> ToolParser:
    if tool_call_parser == "hermes":
        return HermesToolParser()
    return Llama3JsonToolParser() if tool_call_parser == "llama3_json" else JsonToolParser()


def renamed_arguments(call_schema: dict[str, Any], key: str) -> dict[str, Any]:
    """The call schema (one call, or anyOf calls) with its "arguments" property named `key`."""
    if "anyOf" in call_schema:
        return {"anyOf": [renamed_arguments(option, key) for option in call_schema["anyOf"]]}
    properties = {(key if name == "arguments" else name): value for name, value in call_schema["properties"].items()}
    required = [key if name == "arguments" else name for name in call_schema["required"]]
    return {**call_schema, "properties": properties, "required": required}


def framed_grammar(call_schema: dict[str, Any], is_list: bool, compact: bool, before: str, after: str, separator: str) -> str:
    """EBNF: each call is `before` + the call's JSON + `after` (EBNF string literals, or empty),
    several joined by `separator`, around xgrammar's own rendering of the call schema."""
    layout = {"any_whitespace": False, "separators": COMPACT_SEPARATORS} if compact else {"any_whitespace": True}
    try:
        call_json = str(xgr.Grammar.from_json_schema(json.dumps(call_schema), **layout))
    except (ValueError, RuntimeError) as error:  # xgrammar reports a bad schema as either
        reason = str(error).strip().splitlines()[-1][:300] if str(error).strip() else type(error).__name__
        raise FieldError("tools", f"a function's parameters are not a JSON schema xgrammar takes: {reason}") from None
    # xgrammar names the schema's start rule `root`; ours frames it, so it is renamed (rules
    # derived from it, root_0 and the like, keep their names).
    call_json = re.sub(r"^root ::=", "call_json ::=", call_json, flags=re.MULTILINE)
    more = f" ({separator} call)*" if is_list else ""
    frame = f"root ::= call{more}\ncall ::= {' '.join(part for part in (before, 'call_json', after) if part)}\n"
    return frame + call_json
