"""benchmarks/serving.py against a fake OpenAI-compatible streaming server and the in-process
AsyncLLM on the tiny model: the JSON's fields, sane percentiles, the sweep's PNG, the comparison."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import serving  # noqa: E402

FAKE_MODEL = "fake-model"
TOKEN_DELAY_S = 0.002


class FakeServer:
    """Streams one `text_completion` chunk per requested token, then usage and `[DONE]`, and
    remembers what it was sent and how many requests it held at once."""

    def __init__(self):
        self.payloads: list[dict] = []
        self.num_in_flight = 0
        self.max_in_flight = 0

    def app(self):
        # Request is imported at module level: with postponed annotations FastAPI resolves the
        # handler's annotation in the module's namespace.
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": FAKE_MODEL, "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.payloads.append(body)
            return StreamingResponse(self.stream(body), media_type="text/event-stream")

        return app

    async def stream(self, body: dict):
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            for _ in range(body["max_tokens"]):
                await asyncio.sleep(TOKEN_DELAY_S)
                chunk = {"object": "text_completion", "model": FAKE_MODEL, "choices": [{"index": 0, "text": " x", "finish_reason": None}], "usage": None}
                yield f"data: {json.dumps(chunk)}\n\n"
            num_prompt = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].split())
            usage = {"prompt_tokens": num_prompt, "completion_tokens": body["max_tokens"], "total_tokens": num_prompt + body["max_tokens"]}
            yield f"data: {json.dumps({'object': 'text_completion', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.num_in_flight -= 1


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    fake = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound before the server starts: no race for a free port
    server = uvicorn.Server(uvicorn.Config(fake.app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.01)
    yield fake, f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(5)


SMALL = ["--num-prompts", "6", "--input-len", "4:24", "--output-len", "3:10", "--seed", "1"]


def assert_sane(summary: dict, num_prompts: int) -> None:
    assert summary["completed"] == num_prompts and summary["failed"] == 0, summary["errors"]
    assert summary["num_short_outputs"] == 0
    for key in ("request_throughput", "output_token_throughput", "total_token_throughput"):
        assert summary[key] > 0
    assert summary["total_token_throughput"] > summary["output_token_throughput"]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = summary[name]
        assert set(stats) == {"mean", "p50", "p90", "p99"}
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], (name, stats)
    assert summary["ttft_ms"]["p50"] <= summary["e2el_ms"]["p50"]


def test_http_fixed_concurrency_against_fake_server(fake_server, capsys):
    fake, url = fake_server
    fake.payloads.clear()
    fake.max_in_flight = 0
    serving.main(["--base-url", url, "--request-rate", "inf", "--max-concurrency", "2", "--num-warmups", "0", *SMALL])
    report = json.loads(capsys.readouterr().out)
    (summary,) = report["results"]["http"]
    assert_sane(summary, 6)
    assert summary["max_concurrency"] == 2 and fake.max_in_flight == 2
    specs = serving.build_requests(serving.parse_args(SMALL), "rate-0")
    # Output lengths are what was asked (usage), and the server saw ignore_eos and streaming usage.
    assert summary["total_output_tokens"] == sum(spec.output_len for spec in specs)
    assert summary["total_input_tokens"] == sum(spec.prompt_len for spec in specs)
    assert all(p["model"] == FAKE_MODEL and p["ignore_eos"] and p["stream"] for p in fake.payloads)
    assert all(p["stream_options"] == {"include_usage": True} for p in fake.payloads)
    # Each chunk comes after TOKEN_DELAY_S of server time: the gaps cannot be shorter.
    assert summary["itl_ms"]["p50"] >= TOKEN_DELAY_S * 1e3 * 0.9


def test_compare_sweep_inprocess_then_http(fake_server, tmp_path, capsys):
    _, url = fake_server
    plot, output = tmp_path / "latency.png", tmp_path / "report.json"
    argv = ["--compare", "--model-path", "tiny", "--max-model-len", "128", "--base-url", url, "--model", FAKE_MODEL,
            "--request-rates", "20,inf", "--prompt-format", "text", "--plot", str(plot), "--output", str(output), *SMALL]
    serving.main(argv)
    report = json.loads(capsys.readouterr().out)
    assert json.loads(output.read_text()) == report
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["config"]["device"] and report["config"]["engine_args"] == {"max_model_len": 128}
    for backend in ("inprocess", "http"):
        runs = report["results"][backend]
        assert [run["request_rate"] for run in runs] == [20.0, "inf"]
        for run in runs:
            assert_sane(run, 6)
    # Text prompts: the engine counts their real tokens, which differ from the words asked for.
    assert report["results"]["inprocess"][0]["total_input_tokens"] > 0
    first = report["comparison"][0]
    assert first["request_rate"] == 20.0
    http, inprocess = report["results"]["http"][0], report["results"]["inprocess"][0]
    expected = round(http["ttft_ms"]["p99"] - inprocess["ttft_ms"]["p99"], 3)
    assert first["ttft_ms"]["p99"]["diff_ms"] == pytest.approx(expected, abs=2e-3)
    assert first["output_token_throughput"]["ratio"] > 0


def test_unreachable_server_counts_failures(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again below: nothing listens there
    serving.main(["--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--num-warmups", "0", *SMALL])
    (summary,) = json.loads(capsys.readouterr().out)["results"]["http"]
    assert summary["failed"] == 6 and summary["completed"] == 0
    assert summary["errors"] and summary["request_throughput"] == 0


def test_poisson_arrivals_have_the_asked_rate():
    offsets = serving.arrival_offsets(2000, 50.0, seed=0)
    assert offsets == sorted(offsets) and offsets[0] == 0.0
    assert 2000 / offsets[-1] == pytest.approx(50.0, rel=0.1)
    assert serving.arrival_offsets(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]
