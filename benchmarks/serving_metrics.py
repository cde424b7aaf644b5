"""Metrics of an online serving run: per-request timings in, one JSON-able summary out.

Definitions (the ones vLLM's benchmark_serving uses, so figures compare across tools):
- TTFT: request sent -> first content chunk (a chunk with a choice / an engine output).
- ITL: the gap between consecutive content chunks of one request; every gap of every request is
  one sample, so a long request weighs more than a short one.
- TPOT: per request, (e2e - ttft) / (output_tokens - 1); requests of one token have no TPOT.
- e2e: request sent -> last byte of the response.
Latencies are reported in milliseconds; throughputs per second of the run's wall time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """What one request measured; times are seconds from `time.perf_counter`."""

    prompt_len: int
    expected_output_len: int
    is_success: bool = False
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    output_tokens: int = 0  # from `usage` when the server sends it, else counted
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None  # one token: all of its time is TTFT
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def distribution_ms(samples: list[float]) -> dict[str, float]:
    """Mean and percentiles in ms; NaN-free zeros when there are no samples (all failed)."""
    if not samples:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    values = np.asarray(samples) * 1e3
    summary = {"mean": round(float(values.mean()), 3)}
    for p in PERCENTILES:
        summary[f"p{p}"] = round(float(np.percentile(values, p)), 3)
    return summary


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    """The run's summary: counts, throughputs, and each latency's distribution in ms."""
    done = [r for r in results if r.is_success]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.e2el for r in done],
    }
    summary = {
        "duration_s": round(duration_s, 3),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.is_success})[:5],
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        # A server that stops early (ignore_eos not honoured) shows up here, not as a failure.
        "num_short_outputs": sum(r.output_tokens < r.expected_output_len for r in done),
        "request_throughput": round(len(done) / duration_s, 4),
        "output_token_throughput": round(output_tokens / duration_s, 3),
        "total_token_throughput": round((input_tokens + output_tokens) / duration_s, 3),
    }
    for name in LATENCY_METRICS:
        summary[f"{name}_ms"] = distribution_ms(samples[name])
    return summary


def compare(baseline: dict, other: dict) -> dict:
    """`other` against `baseline` at the same load: latency differences (ms) and ratios.

    Used for the Serve path against in-process AsyncLLM, so a positive `diff_ms` is what the HTTP
    hop, the Serve handle and the SSE encoding add on top of the engine.
    """
    report: dict = {}
    for name in LATENCY_METRICS:
        key = f"{name}_ms"
        report[key] = {
            stat: {"diff_ms": round(other[key][stat] - base, 3), "ratio": _ratio(other[key][stat], base)}
            for stat, base in baseline[key].items()
        }
    for key in ("request_throughput", "output_token_throughput"):
        report[key] = {"ratio": _ratio(other[key], baseline[key])}
    return report


def _ratio(value: float, base: float) -> float | None:
    return round(value / base, 4) if base > 0 else None


def rate_label(rate: float | str) -> str:
    """A rate as the report writes it: a number, or "inf" (JSON has no infinity)."""
    if isinstance(rate, str) or math.isinf(rate):
        return "inf"
    return f"{rate:g}"


def plot_sweep(runs: dict[str, list[dict]], path: Path) -> Path:
    """TTFT, TPOT and ITL percentiles against request rate; one line style per backend.

    The x axis is categorical (evenly spaced rates, labelled) because `inf` has no position on a
    numeric axis and sweeps are usually geometric anyway.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot's import
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    styles = {"inprocess": "--", "http": "-"}
    for axis, name in zip(axes, ("ttft", "tpot", "itl")):
        for backend, summaries in runs.items():
            positions = range(len(summaries))
            for p, color in zip(PERCENTILES, ("tab:blue", "tab:orange", "tab:red")):
                values = [s[f"{name}_ms"][f"p{p}"] for s in summaries]
                axis.plot(positions, values, styles.get(backend, ":"), color=color, marker="o", label=f"{backend} p{p}")
            axis.set_xticks(list(positions), [rate_label(s["request_rate"]) for s in summaries])
        axis.set_title(f"{name.upper()} (ms)")
        axis.set_xlabel("request rate (req/s)")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
