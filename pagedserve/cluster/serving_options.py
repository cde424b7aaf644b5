"""The OpenAI front end's settings that come from the server's config (ServerConfig's fields of
the same names, vLLM's flags): tool-call and reasoning parsers, where request defaults come
from, and how the engine is reached. The ingress holds one per served model."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.cluster.reasoning_parsers import get_reasoning_parser
from pagedserve.cluster.tool_parsers import get_tool_parser


@dataclass(frozen=True)
class ServingOptions:
    enable_auto_tool_choice: bool = False  # tool_choice "auto" parses calls out of free text
    tool_call_parser: str | None = None  # tool_parsers.TOOL_PARSERS
    reasoning_parser: str | None = None  # reasoning_parsers.REASONING_PARSERS
    generation_config: str = "auto"  # "auto": the model folder's generation_config.json; "vllm": none; or a folder
    engine_transport: str = "grpc"  # how the ingress calls the LLMServer replicas (serve_engine_client.TRANSPORTS)

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # raises, naming the known ones
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
