"""Serve is started once per session on a free port; each test module deploys the apps it needs
(under their own route prefixes) and deletes them when it is done."""

from __future__ import annotations

import socket
import time

import requests


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_ports(count: int, taken: set[int]) -> list[int]:
    """`count` free ports, distinct from each other and from `taken` (ports handed out earlier
    that their process may not have bound yet), which gains them. Calling free_port() once per
    port can give one number twice: each socket closes before the next binds (seen: a Ray head
    told to put its GCS and its dashboard agent on one port)."""
    sockets, ports = [], []
    try:
        while len(ports) < count:
            sock = socket.socket()
            sockets.append(sock)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            if port not in taken:
                ports.append(port)
                taken.add(port)
    finally:
        for sock in sockets:
            sock.close()
    return ports


def metric_per_replica(base_url: str, name: str, model: str | None = None) -> dict[str, float]:
    """A sample's value in /metrics for each replica (its `replica` label), of `model` if named.
    The hub hears from each replica every second."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{base_url}/metrics", timeout=10).text
    return {
        sample.labels["replica"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and model in (None, sample.labels.get("model_name"))
    }


def deploy(config, name: str, route_prefix: str) -> None:
    from ray import serve

    from pagedserve.cluster.app import build_app

    serve.run(build_app(config), name=name, route_prefix=route_prefix)


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition", details=lambda: ""):
    """Poll until predicate() is truthy; returns its value, or raises after `timeout` seconds
    naming `what`, with `details()` (say, a log tail) appended."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout} s\n{details()}".rstrip())
        time.sleep(interval)


def metric_values(base_url: str) -> dict[tuple[str, tuple], float]:
    """/metrics' samples by (name, sorted labels), summed over the `replica` label (PromQL's
    `sum without (replica)`): a server exports one series per replica."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{base_url}/metrics", timeout=10).text
    values: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "replica"))
            values[(sample.name, labels)] = values.get((sample.name, labels), 0.0) + sample.value
    return values
