"""Who answers HTTP on `pagedserve serve`'s port (`http_ingress`, cluster/launcher.py): the
ingress replica itself where the command starts Ray (Serve's direct ingress, set through the
environment every Ray process it starts inherits), Serve's proxy on a cluster already running.
tests/cluster/test_cli_serve.py and tests/e2e/test_real_model.py run both for real."""

from __future__ import annotations

import socket

import pytest

from pagedserve.cluster.launcher import check_port_is_free, direct_ingress_environment, free_port, uses_direct_ingress
from pagedserve.cluster.server_config import SERVE_DIRECT_INGRESS_VARIABLE, ServerConfig


@pytest.mark.parametrize(
    ("http_ingress", "starts_ray", "direct"),
    [("auto", True, True), ("auto", False, False), ("direct", True, True), ("proxy", True, False), ("proxy", False, False)],
)
def test_direct_where_this_command_starts_ray_unless_told(http_ingress, starts_ray, direct):
    assert uses_direct_ingress(ServerConfig(http_ingress=http_ingress), starts_ray) is direct


def test_direct_on_a_running_cluster_is_an_error_naming_the_way_out():
    with pytest.raises(ValueError, match="RAY_ADDRESS.*'proxy' or 'auto'"):
        uses_direct_ingress(ServerConfig(http_ingress="direct"), starts_ray=False)


def test_an_unknown_value_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="'auto', 'direct' or 'proxy'"):
        ServerConfig(http_ingress="haproxy")


def test_the_ingress_gets_exactly_the_port_and_no_drain_window():
    environ = {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "30000", "OTHER": "kept"}
    direct_ingress_environment(8123, environ)
    assert environ == {
        "OTHER": "kept",
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "8123",
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "8124",  # exclusive: one port
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


def test_a_port_in_use_is_named_before_ray_starts():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot serve on 127.0.0.1:{port}.*choose another --port"):
            check_port_is_free("127.0.0.1", port)
    check_port_is_free("127.0.0.1", port)  # released: free again


def test_a_port_whose_server_just_closed_its_connections_counts_as_held():
    """Serve binds without SO_REUSEADDR, so a port a stopped server's closed connections still
    hold (TIME_WAIT) would fail there: the check says so first."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server closes first: its end waits out TIME_WAIT
            assert client.recv(1) == b""
    with pytest.raises(ValueError, match="Address already in use.*wait"):
        check_port_is_free("127.0.0.1", port)


def test_the_proxy_gets_a_port_nothing_holds():
    port = free_port("127.0.0.1")
    check_port_is_free("127.0.0.1", port)


def test_a_serve_config_asking_for_direct_on_a_cluster_without_it_is_refused(monkeypatch):
    """`serve deploy` with http_ingress 'direct' on a cluster whose processes lack Serve's switch."""
    from pagedserve.cluster.app import build_app

    monkeypatch.delenv(SERVE_DIRECT_INGRESS_VARIABLE, raising=False)
    with pytest.raises(ValueError, match=f"{SERVE_DIRECT_INGRESS_VARIABLE}=1 .*this cluster lacks it: use 'auto' or 'proxy'"):
        build_app({"http_ingress": "direct"})

