"""Structured outputs over HTTP: OpenAI's `response_format` and vLLM's `structured_outputs` extra
field, validated where the request enters and mapped onto the engine's `StructuredOutputsParams`.

A request may give `response_format` (OpenAI) or a constraint in `structured_outputs` (vLLM), not
both; `structured_outputs` may also carry only options (`disable_any_whitespace`,
`disable_additional_properties`), which then apply to the grammar `response_format` or a forced
tool call asks for. JSON is compact unless a request sets `disable_any_whitespace: false`
(docs/structured-outputs.md says why this differs from vLLM's default).
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.sampling_params import StructuredOutputsParams

# OpenAI's rule for a response format's (and a function's) name.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class FieldError(ValueError):
    """A request field's value the engine cannot serve: the 400 names `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: OpenAI's named schema. `schema` absent: any JSON object."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    # `schema` shadows a BaseModel attribute in pydantic: stored as json_schema, sent as "schema".
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatText(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]


class ResponseFormatJsonObject(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["json_object"]


class ResponseFormatJsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Union[ResponseFormatText, ResponseFormatJsonObject, ResponseFormatJsonSchema]


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request field (at most one constraint kind; options alone are
    allowed and apply to the grammar `response_format` or a forced tool call sets)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: Union[dict[str, Any], str, None] = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = True  # False: JSON may hold free whitespace (vLLM's default)
    disable_additional_properties: bool = False

    def kinds(self) -> dict[str, Any]:
        """The constraint kinds this field sets, by vLLM's name."""
        values = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                  "json_object": self.json_object or None, "structural_tag": self.structural_tag}
        return {name: value for name, value in values.items() if value is not None}


def structured_outputs_params(
    response_format: ResponseFormat | None, field: StructuredOutputsField | None, forced: dict[str, Any] | None = None
) -> StructuredOutputsParams | None:
    """The engine's constraint for a request, or None for free text. `forced`: the constraint
    (kind -> spec) a forced tool call imposes (tool_choice required or named). Raises FieldError."""
    kinds: dict[str, tuple[str, dict[str, Any]]] = {}  # request field -> (its name for the 400, kind)
    if response_format is not None and response_format.type != "text":
        kinds["response_format"] = ("response_format", _from_response_format(response_format))
    if field is not None and field.kinds():
        kinds["structured_outputs"] = ("structured_outputs", field.kinds())
    if forced is not None:
        kinds["tool_choice"] = ("tool_choice", forced)
    if len(kinds) > 1:
        names = " and ".join(kinds)
        raise FieldError(next(iter(kinds)), f"{names} each constrain the output; give only one")
    if not kinds:
        return None
    param, spec = next(iter(kinds.values()))
    if len(spec) > 1:
        raise FieldError(param, f"set exactly one of json, regex, choice, grammar, json_object, structural_tag; got {', '.join(spec)}")
    options = {"disable_any_whitespace": True, "disable_additional_properties": False}
    if field is not None:
        options = {"disable_any_whitespace": field.disable_any_whitespace, "disable_additional_properties": field.disable_additional_properties}
    strict = response_format is not None and response_format.type == "json_schema" and response_format.json_schema.strict
    if strict:  # OpenAI's strict mode: objects are closed unless the schema opens them
        options["disable_additional_properties"] = True
    try:
        return StructuredOutputsParams(**spec, **options)
    except ValueError as error:
        raise FieldError(param, _without_class_prefix(str(error))) from None


def _from_response_format(response_format: ResponseFormat) -> dict[str, Any]:
    if response_format.type == "json_object":
        return {"json_object": True}
    schema = response_format.json_schema.json_schema
    return {"json_object": True} if schema is None else {"json": schema}


def _without_class_prefix(message: str) -> str:
    return message.removeprefix("StructuredOutputsParams.")
