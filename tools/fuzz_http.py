"""Fuzz a running pagedserve HTTP API with schemathesis, from the server's own /openapi.json.

For every documented operation schemathesis generates schema-valid bodies (positive mode) and
schema-violating ones (negative mode); each response goes through all of schemathesis' response
checks (no 5xx, status codes and content types the schema documents, response bodies and headers
that conform to it, schema-violating data rejected) but one, plus this server's own: no traceback
text, and every refusal a short JSON body in OpenAI's error shape. The one left out,
`positive_data_acceptance`, demands a 2xx for every schema-valid body; but validity here also
depends on the model and the engine (token ids within the vocabulary, a prompt within
max_model_len, a served model name, ranges SamplingParams checks), which no schema states, so
such bodies are rightly refused with a 400 (or a 404). Half the generated bodies name the
served model, so they reach the engine rather than stopping at a 404.

After the run the server must be healthy and its KV cache empty (from /metrics). The JSON
summary (calls, status codes and failures per operation and mode) goes to stdout and `--output`;
the exit status is 1 when anything failed.

    # start a server on the demo model in this process (Ray + Serve on a free port), fuzz it
    python tools/fuzz_http.py --max-examples 500 --output benchmarks/results/fuzz_http_cpu.json
    # a running server
    python tools/fuzz_http.py --url http://127.0.0.1:8000 --max-examples 2000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as fixed_seed
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode, checks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from common import write_report  # noqa: E402

# Longer than any refusal needs: a body that echoes a huge input back is itself a failure.
MAX_ERROR_BODY_BYTES = 4096
ERROR_FIELDS = {"message", "type", "code", "param"}
# How long the engine may take to finish what the last requests started.
IDLE_TIMEOUT_S = 60.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server's base URL; default: start one in this process")
    parser.add_argument("--model-path", default="demo", help="checkpoint folder or 'demo' (in-process server)")
    parser.add_argument("--max-model-len", type=int, default=256, help="of the in-process server")
    parser.add_argument("--model", help="model name to put in bodies (default: the server's first)")
    parser.add_argument("--max-examples", type=int, default=1000, help="per operation and generation mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="also write the JSON summary here")
    return parser.parse_args(argv)


def error_problems(status: int, content_type: str, body: bytes) -> list[str]:
    """What is wrong with a response as a refusal should look (empty: nothing)."""
    problems = []
    if b"Traceback" in body or b'File "/' in body:
        problems.append("a traceback in the body")
    if status >= 500:
        problems.append(f"status {status}")
    if status < 400:
        return problems
    if len(body) > MAX_ERROR_BODY_BYTES:
        problems.append(f"a {len(body)}-byte error body")
    if not content_type.startswith("application/json"):
        return problems + [f"an error with content type {content_type!r}"]
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return problems + ["an error body not in OpenAI's shape"]
    if not isinstance(error, dict) or not ERROR_FIELDS <= set(error) or not error.get("message"):
        problems.append(f"an error without {sorted(ERROR_FIELDS)} and a message: {error!r:.200}")
    return problems


def assert_clean_error(status: int, content_type: str, body: bytes) -> None:
    problems = error_problems(status, content_type, body)
    assert not problems, (problems, body[:500])


# ---- the schemathesis run ---------------------------------------------------------------------


class OperationFuzzer:
    """Runs one operation in one generation mode through hypothesis, recording every call."""

    def __init__(self, operation, mode, base_url: str, model: str, session: requests.Session):
        self.operation, self.mode, self.base_url, self.model, self.session = operation, mode, base_url, model, session
        self.statuses: Counter[int] = Counter()
        self.failure: str | None = None

    def run(self, max_examples: int, seed: int) -> dict:
        @fixed_seed(seed)
        @given(case=self.operation.as_strategy(generation_mode=self.mode), use_served_model=st.booleans())
        @settings(
            max_examples=max_examples,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],  # report the first failure as found, unshrunk
            suppress_health_check=list(HealthCheck),
        )
        def call(case, use_served_model):
            self._call(case, use_served_model)

        try:
            call()
        except Unsatisfiable:  # nothing to violate: an operation without parameters or body
            pass
        except (Exception, BaseExceptionGroup) as error:  # the first failure ends this operation's run
            self.failure = f"{type(error).__name__}: {error}"[:4000]
        return {"calls": sum(self.statuses.values()), "statuses": dict(sorted(self.statuses.items())), "failure": self.failure}

    def _call(self, case, use_served_model: bool) -> None:
        # Only schema-valid bodies: in a violating one the model may be the very part that violates.
        is_positive = self.mode == GenerationMode.POSITIVE
        if use_served_model and is_positive and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = self.model
        response = case.call(base_url=self.base_url, session=self.session, timeout=120)
        self.statuses[response.status_code] += 1
        content_type = (response.headers.get("content-type") or [""])[0]  # lowercase keys, list values
        problems = error_problems(response.status_code, content_type, response.content)
        assert not problems, f"{problems}: {case.as_curl_command()[:1000]} -> {response.content[:300]!r}"
        case.validate_response(response, excluded_checks=[checks.positive_data_acceptance])


def fuzz(base_url: str, max_examples: int, seed: int = 0, model: str | None = None) -> dict:
    """Every operation in both generation modes; returns the summary (see the module docstring)."""
    start = time.monotonic()
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    session = requests.Session()
    model = model or session.get(f"{base_url}/v1/models", timeout=60).json()["data"][0]["id"]
    operations = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzzer = OperationFuzzer(operation, mode, base_url, model, session)
            operations[f"{operation.label} [{mode.value}]"] = fuzzer.run(max_examples, seed)
    health = session.get(f"{base_url}/health", timeout=60).status_code
    kv_usage = _wait_for_empty_kv(session, base_url)
    failures = {label: op["failure"] for label, op in operations.items() if op["failure"]}
    return {
        "benchmark": "fuzz_http",
        "url": base_url,
        "max_examples": max_examples,
        "seed": seed,
        "elapsed_s": round(time.monotonic() - start, 1),
        "num_calls": sum(op["calls"] for op in operations.values()),
        "statuses": dict(sorted(sum((Counter(op["statuses"]) for op in operations.values()), Counter()).items())),
        "operations": operations,
        "health_after": health,
        "kv_cache_usage_after": kv_usage,
        "failures": failures,
        "passed": not failures and health == 200 and kv_usage == 0,
    }


def _wait_for_empty_kv(session: requests.Session, base_url: str) -> float:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        text = session.get(f"{base_url}/metrics", timeout=60).text
        usage = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("pagedserve:kv_cache_usage_perc{"))
        if usage == 0 or time.monotonic() > deadline:
            return usage
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    url = args.url
    if url is None:
        from soak import start_server  # a sibling tool

        url = start_server(args.model_path, {"max_model_len": args.max_model_len}, "fuzz")
    summary = fuzz(url.rstrip("/"), args.max_examples, args.seed, args.model)
    write_report(summary, args.output, argv)  # with the commit, the machine and the command line
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
