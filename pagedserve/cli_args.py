"""Command-line flags generated from pydantic config fields, so flags map 1:1 onto fields.

`--max-model-len 512` sets `max_model_len`; booleans get `--flag` / `--no-flag`. Only flags the
user actually gives are returned, so a YAML file's values survive unless a flag overrides them.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel


def add_model_arguments(parser: argparse.ArgumentParser, model: type[BaseModel], skip: tuple[str, ...] = (), title: str | None = None) -> None:
    group = parser.add_argument_group(title or f"{model.__name__} fields")
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        kind, choices = _flag_type(field.annotation)
        flag = "--" + name.replace("_", "-")
        # argparse formats help with %: a description's own % ("12% faster") must be escaped.
        help_text = ((field.description or "") + f" (default: {field.default!r})").replace("%", "%%")
        if kind is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        elif typing.get_origin(field.annotation) is list:  # --lora-modules a=PATH b=PATH
            group.add_argument(flag, dest=name, nargs="+", default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument(flag, dest=name, type=kind, choices=choices, default=argparse.SUPPRESS, help=help_text)


def given_fields(args: argparse.Namespace, *models: type[BaseModel]) -> dict[str, Any]:
    """The config fields the user set on the command line (defaults are suppressed)."""
    return {name: value for name, value in vars(args).items() if any(name in m.model_fields for m in models)}


def _flag_type(annotation: Any) -> tuple[Any, list | None]:
    """(argparse type, choices) for a field annotation such as `int | None` or a Literal."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _flag_type(args[0])
    if origin is Literal:
        values = [a for a in args if a is not None]
        return type(values[0]), values
    if annotation in (int, float, str, bool):
        return annotation, None
    if origin is dict or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return _json_object, None  # a nested settings object: --autoscaling '{"max_replicas": 4}'
    return str, None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
