"""How a forced tool call (tool_choice "required" or a named function) is written: in the model's
own format where the server's --tool-call-parser names one a grammar can frame (hermes:
`<tool_call>\n{...}\n</tool_call>`, one block per call), else as plain JSON (a call object, or a
list of them). Either way the call is valid by construction, and the same format's parser reads
it back.

The hermes frame is an EBNF grammar around xgrammar's own rendering of the call's JSON schema
(compact unless the request asks for free whitespace), so it needs the xgrammar backend (the
engine's default).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedserve.cluster.structured_requests import FieldError
from pagedserve.cluster.tool_parsers import ToolParser
from pagedserve.cluster.tool_parsers.hermes import END, START, HermesToolParser
from pagedserve.cluster.tool_parsers.json_calls import JsonToolParser
from pagedserve.cluster.tool_requests import ForcedCall

FRAMED_FORMATS = ("hermes",)  # parsers whose markers are plain text a grammar can write


def forced_call_spec(forced: ForcedCall, tool_call_parser: str | None, compact: bool) -> dict[str, Any]:
    """The StructuredOutputsParams constraint (kind -> spec) of a forced call."""
    if tool_call_parser == "hermes":
        return {"grammar": hermes_grammar(forced, compact)}
    return {"json": forced.json_schema()}


def forced_call_parser(tool_call_parser: str | None) -> ToolParser:
    return HermesToolParser() if tool_call_parser in FRAMED_FORMATS else JsonToolParser()


def hermes_grammar(forced: ForcedCall, compact: bool) -> str:
    import xgrammar as xgr

    try:
        call_json = str(xgr.Grammar.from_json_schema(json.dumps(forced.call_schema), any_whitespace=not compact))
    except (ValueError, RuntimeError) as error:  # xgrammar reports a bad schema as either
        reason = str(error).strip().splitlines()[-1][:300] if str(error).strip() else type(error).__name__
        raise FieldError("tools", f"a function's parameters are not a JSON schema xgrammar takes: {reason}") from None
    # xgrammar names the schema's start rule `root`; ours frames it, so it is renamed (rules
    # derived from it, root_0 and the like, keep their names).
    call_json = re.sub(r"^root ::=", "call_json ::=", call_json, flags=re.MULTILINE)
    more = ' ("\\n" call)*' if forced.is_list else ""
    frame = f"root ::= call{more}\ncall ::= {json.dumps(START + chr(10))} call_json {json.dumps(chr(10) + END)}\n"
    return frame + call_json
