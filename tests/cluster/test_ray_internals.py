"""The fence around Ray's internals (cluster/ray_internals.py): the version check fails loudly on a
Ray it was not tested with, and the error text it reads is the one this Ray writes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.cluster.ray_internals import (
    ALLOW_UNTESTED_RAY_ENV,
    UntestedRayError,
    actor_death,
    check_ray_version,
    is_stopped_by_serve,
)
from tests.cluster.conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version", ["2.60.0", "2.60.3"])
def test_a_tested_ray_passes(version):
    check_ray_version(version)


@pytest.mark.parametrize("version", ["2.59.1", "2.61.0", "3.0.0", "2.6.0"])
def test_an_untested_ray_stops_with_a_clear_error(version):
    with pytest.raises(UntestedRayError, match=rf"Ray {version} is installed: install ray\[serve\]==2\.60\.\*.*{ALLOW_UNTESTED_RAY_ENV}=1"):
        check_ray_version(version)


def test_an_untested_ray_may_be_tried_on_purpose(caplog):
    check_ray_version("2.61.0", allow_untested=True)
    assert "Ray 2.61.0 is installed" in caplog.text


def _import_with_ray_version(version: str, **env: str) -> subprocess.CompletedProcess:
    code = f"import ray; ray.__version__ = {version!r}; import pagedserve.cluster.prefix_router"
    environ = {name: value for name, value in os.environ.items() if name != ALLOW_UNTESTED_RAY_ENV}
    environ.update(PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)


def test_importing_the_cluster_on_an_untested_ray_fails_at_once():
    """The routers (what Serve imports first in a replica) import the fence, so the check runs
    before any of Serve's private names is touched."""
    result = _import_with_ray_version("2.99.0")
    assert result.returncode != 0
    assert "UntestedRayError" in result.stderr and "Ray 2.99.0 is installed" in result.stderr


def test_the_escape_hatch_lets_the_import_go_on():
    result = _import_with_ray_version("2.99.0", **{ALLOW_UNTESTED_RAY_ENV: "1"})
    assert result.returncode == 0, result.stderr


def test_an_actor_ended_by_ray_kill_reads_as_stopped_and_a_crash_does_not(ray_cluster):
    """The text `is_stopped_by_serve` looks for is what this Ray puts in the error of a call to
    an actor ended by `ray.kill` (what Serve's controller does to a stopped replica)."""
    import ray
    from ray.exceptions import RayActorError

    killed, crashed = _sleepers(2)
    assert ray.get([killed.ping.remote(), crashed.ping.remote()]) == [True, True]
    ray.kill(killed, no_restart=True)
    # `ray.kill` only asks the GCS: a call sent at once may still run (a CI run saw one answer).
    stopped = wait_until(lambda: _actor_error(killed), timeout=60, what="the killed actor's calls to fail")
    with pytest.raises(RayActorError) as died:
        ray.get(crashed.crash.remote(), timeout=60)
    assert is_stopped_by_serve(stopped)
    assert not is_stopped_by_serve(died.value)


def test_the_gcs_records_ray_kill_as_the_death_of_a_killed_actor_only(ray_cluster):
    """What ServeEngineClient asks over Serve's gRPC transport, whose errors carry no such text:
    `actor_death` reads the GCS's record of a killed actor, a crashed one, and a live one."""
    import ray

    killed, crashed, alive = _sleepers(3)
    assert ray.get([actor.ping.remote() for actor in (killed, crashed, alive)]) == [True] * 3
    ray.kill(killed, no_restart=True)
    crashed.crash.remote()
    deaths = {
        name: wait_until(lambda actor=actor: actor_death(actor._actor_id.hex()), timeout=60, what=f"the {name} actor's death record")
        for name, actor in (("killed", killed), ("crashed", crashed))
    }
    assert deaths == {"killed": "RAY_KILL", "crashed": "WORKER_DIED"}
    assert actor_death(alive._actor_id.hex()) is None


def _sleepers(count: int) -> list:
    """`count` idle actors that answer `ping` and die at once on `crash`, never restarted."""
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class Sleeper:
        def ping(self) -> bool:
            return True

        def crash(self) -> None:
            os._exit(1)

    return [Sleeper.remote() for _ in range(count)]


def _actor_error(actor) -> BaseException | None:
    """The error a call to `actor` ends in, or None while it still answers."""
    import ray
    from ray.exceptions import RayActorError

    try:
        ray.get(actor.ping.remote(), timeout=60)
    except RayActorError as error:
        return error
    return None
