"""pagedserve/ray_env.py's Ray settings for a cluster it starts. That the replicas and the engine
then run at the starter's niceness is checked on real clusters: tests/cluster/test_cli_serve.py
(the launcher), test_cluster_yaml_auth.py (the YAML's `ray start`), tests/helm/test_operator_play.py
(the chart's pods)."""

from pagedserve.ray_env import WORKER_NICENESS_VARIABLE, worker_niceness_config


def test_workers_start_at_the_raylets_niceness():
    assert worker_niceness_config({}) == {"worker_niceness": 0}


def test_a_niceness_the_user_exported_wins():
    # Ray reads the variable itself; a system config would override it, so none is given.
    assert worker_niceness_config({WORKER_NICENESS_VARIABLE: "10"}) == {}
