"""The `pagedserve` command.

- `pagedserve serve [--config FILE.yaml] [flags]`: the OpenAI-compatible server on Ray Serve.
  With no arguments it serves the built-in demo model.
- `pagedserve generate [flags]`: complete prompts offline and print them.

Every config field is a flag (`--max-model-len`, `--tensor-parallel-size`, `--num-replicas`, ...);
flags override the YAML file. Run `pagedserve serve --help` for the list.
"""

from __future__ import annotations

import argparse
import json
import sys

from pagedserve.cli_args import add_model_arguments, given_fields
from pagedserve.cluster.server_config import DeploymentConfig, ServerConfig
from pagedserve.config import EngineConfig

DEMO_PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Once upon a time there was a small server",
    "Tell me a story about a dragon who learned to read.",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve", description="A distributed LLM inference server on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_serve(commands)
    _add_generate(commands)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"pagedserve: error: {error}", file=sys.stderr)
        return 2


def _add_serve(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("serve", help="serve the OpenAI-compatible API on Ray Serve")
    parser.add_argument("--config", help="a YAML file of server settings (see configs/local.yaml)")
    add_model_arguments(parser, ServerConfig, skip=("engine", "deployment"), title="server")
    # The settings the server holds and hands the engine (reasoning_parser, generation_config)
    # are its flags, once.
    shared = tuple(name for name in EngineConfig.model_fields if name in ServerConfig.model_fields)
    add_model_arguments(parser, EngineConfig, skip=("model", *shared), title="engine (YAML: under engine:)")
    add_model_arguments(parser, DeploymentConfig, title="deployment (YAML: under deployment:)")
    parser.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from pagedserve.cluster.launcher import serve_forever

    config = ServerConfig.load(args.config, given_fields(args, ServerConfig, EngineConfig, DeploymentConfig))
    return serve_forever(config)


def _add_generate(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("generate", help="complete prompts offline and print the results")
    parser.add_argument("--model", default="demo", help="a local HF folder, a .gguf file, a hub id, 'demo' (default) or 'tiny'")
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for several); default: demo prompts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="seed of every request's sampling")
    parser.add_argument("--json", action="store_true", help="print one JSON object per completion")
    add_model_arguments(parser, EngineConfig, skip=("model",))
    parser.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from pagedserve import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed
    )
    engine_args = {k: v for k, v in given_fields(args, EngineConfig).items() if k != "model"}
    llm = LLM(args.model, **engine_args)
    try:
        outputs = llm.generate(args.prompt or DEMO_PROMPTS, params)
    finally:
        llm.shutdown()
    for output in outputs:
        completion = output.outputs[0]
        if args.json:
            record = {"prompt": output.prompt, "text": completion.text, "token_ids": completion.token_ids, "finish_reason": completion.finish_reason}
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(f"{output.prompt!r} -> {completion.text!r}  [{completion.finish_reason}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
