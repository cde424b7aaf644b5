"""Regenerate the `server:` part of helm/pagedserve/values.schema.json from the pydantic config
models, so the chart's schema never drifts from ServerConfig / EngineConfig / DeploymentConfig.

    python tools/values_schema.py          # rewrite the file
    python tools/values_schema.py --check  # exit 1 if it is out of date (tests/helm runs this check)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import BaseModel

SCHEMA = Path(__file__).resolve().parents[1] / "helm" / "pagedserve" / "values.schema.json"
# Hand-written entries the models cannot say: the chart refuses a plain-text key.
OVERRIDES = {"api_key": {"anyOf": [{"type": "string"}, {"type": "null"}], "description": "Never set here: the chart refuses a plain-text key. Use apiKey.secretName."}}


def field_schemas(model: type[BaseModel], skip: tuple[str, ...] = ()) -> dict:
    """Each field's JSON schema as pydantic writes it, without titles and defaults (values.yaml has those)."""
    schema = model.model_json_schema()
    properties = inline_refs(schema["properties"], schema.get("$defs", {}))
    return {name: {k: v for k, v in schema.items() if k not in ("title", "default")} for name, schema in properties.items() if name not in skip}


def inline_refs(node, defs: dict):
    """A nested model's schema in place of pydantic's `$ref` to `$defs` (the values schema has no
    `$defs`), without its title."""
    if isinstance(node, list):
        return [inline_refs(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].removeprefix("#/$defs/")]
        return inline_refs({k: v for k, v in target.items() if k != "title"}, defs)
    return {key: inline_refs(value, defs) for key, value in node.items()}


def server_properties(existing: dict) -> dict:
    from pagedserve.cluster.server_config import DeploymentConfig, ServerConfig
    from pagedserve.config import EngineConfig

    properties = field_schemas(ServerConfig, skip=("engine", "deployment"))
    properties.update(OVERRIDES)
    engine = {**existing["engine"], "properties": field_schemas(EngineConfig, skip=("model",))}
    deployment = {**existing["deployment"], "properties": field_schemas(DeploymentConfig)}
    return {**properties, "engine": engine, "deployment": deployment}


def regenerated() -> dict:
    schema = json.loads(SCHEMA.read_text())
    server = schema["properties"]["server"]
    server["properties"] = server_properties(server["properties"])
    return schema


def main(argv: list[str]) -> int:
    schema = regenerated()
    text = json.dumps(schema, indent=2) + "\n"
    if "--check" in argv:
        if json.loads(SCHEMA.read_text()) != schema:
            print(f"{SCHEMA} is out of date: run python tools/values_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
