"""Which backend takes a spec, checked where a request enters (no tokenizer work: cheap)."""

from __future__ import annotations

import functools
import json

from pagedserve.engine.structured_outputs.backend import GrammarBackend
from pagedserve.engine.structured_outputs.guidance_backend import GuidanceBackend
from pagedserve.engine.structured_outputs.xgrammar_backend import XgrammarBackend
from pagedserve.sampling_params import StructuredOutputsParams

BACKENDS: dict[str, type[GrammarBackend]] = {"xgrammar": XgrammarBackend, "guidance": GuidanceBackend}


def resolve_backend_name(params: StructuredOutputsParams, setting: str) -> str:
    """`_resolve`, remembered per spec: schemas repeat, and each request is checked twice (where it
    enters and in the engine core)."""
    return _resolve_cached(params.cache_key(), setting)


@functools.lru_cache(maxsize=1024)
def _resolve_cached(key: tuple, setting: str) -> str:
    kind, spec, disable_any_whitespace, disable_additional_properties = key
    value = {"choice": json.loads(spec) if kind == "choice" else None, "json_object": True}.get(kind, spec)
    params = StructuredOutputsParams(
        **{kind: value}, disable_any_whitespace=disable_any_whitespace,
        disable_additional_properties=disable_additional_properties,
    )
    return _resolve(params, setting)


def _resolve(params: StructuredOutputsParams, setting: str) -> str:
    """The backend for this spec under the engine's `structured_outputs_backend` setting. "auto"
    is xgrammar, or llguidance for a spec xgrammar cannot take (a Lark grammar, a schema feature
    it lacks). Raises ValueError naming the field and why when no allowed backend takes it."""
    if setting != "auto":
        if setting not in BACKENDS:
            raise ValueError(f"structured_outputs_backend={setting!r} is invalid: allowed are auto, xgrammar, guidance")
        BACKENDS[setting].check(params)
        return setting
    try:
        XgrammarBackend.check(params)
        return "xgrammar"
    except ValueError as xgrammar_error:
        try:
            GuidanceBackend.check(params)
        except ValueError:
            raise xgrammar_error from None
        return "guidance"


def validate_structured_outputs(params: StructuredOutputsParams, setting: str = "auto") -> None:
    """Raise ValueError if no backend allowed by `setting` can take the spec."""
    resolve_backend_name(params, setting)
