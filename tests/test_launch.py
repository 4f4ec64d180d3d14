"""gradsync.launch: the same defaults as `gradsync run`, and a function that calls gradsync.init() itself."""
import os

import pytest

import gradsync
from jobs import init_then_train, reference_mlp
from helpers import max_diff

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(120)
def test_ps_launch_without_servers_gets_one_and_a_script_style_init_joins_the_job():
    states = gradsync.launch(init_then_train, strategy="ps", workers=2, args=(3, {}), timeout=110)
    assert all(max_diff(state, reference_mlp(3, 2)) <= 1e-5 for state in states)


@pytest.mark.timeout(120)
def test_init_inside_launch_asking_for_another_job_is_refused_by_name():
    with pytest.raises(gradsync.JobFailed, match=r"asked for mode='async' \(the job runs 'sync'\)"):
        gradsync.launch(init_then_train, strategy="ps", workers=1, args=(1, {"mode": "async"}), timeout=110)


def test_a_second_init_outside_launch_is_refused():
    import types

    from gradsync.runtime import cluster

    cluster.set_running(types.SimpleNamespace(config=None))
    try:
        with pytest.raises(RuntimeError, match="already called"):
            gradsync.init(strategy="allreduce", servers=0)
    finally:
        cluster.set_running(None)
