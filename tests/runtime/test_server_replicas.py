"""replicas 1: every shard is kept on the next server too, a step is answered once both copies hold it, and when a
server dies its shard's replica serves it: the job ends bit for bit as without the death, wherever in the step the
server died."""
import pytest
import torch

import gradsync
from replicated import ServerDeath, train, train_clicks

pytestmark = pytest.mark.job

STEPS = 8
SHAPES = {  # function, servers, workers, its arguments after the death, the death, settings
    "a push mid-step, two servers, three workers": (train, 2, 3, (STEPS,), ServerDeath(1, 3, "pushed"), {}),
    "a clipped step held, three servers": (train, 3, 2, (STEPS, 0.5), ServerDeath(0, 4, "held"), {}),
    "tables served by rows and a GradScaler, the step applied but unanswered": (
        train_clicks, 2, 2, (STEPS,), ServerDeath(0, 3, "closed"), {}),
    "a server stopped until the launcher kills it": (
        train, 2, 2, (STEPS,), ServerDeath(1, 2, "stop"), dict(step_timeout=3.0)),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_job_ends_bit_for_bit_as_without_the_server_death(launch, shape, capfd):
    fn, servers, workers, args, death, settings = SHAPES[shape]
    runs = {run: launch(fn, strategy="ps", workers=workers, servers=servers, timeout=200, replicas=1, **settings,
                        args=(() if run == "clean" else (death,), *args))
            for run in ("clean", "died")}
    err = capfd.readouterr().err
    for w, ((clean, _), (died, stats)) in enumerate(zip(runs["clean"], runs["died"])):
        assert clean.keys() == died.keys() and all(torch.equal(clean[k], died[k]) for k in clean), w
        moved = stats[death.server]
        assert moved["version"] == runs["clean"][w][1][death.server]["version"]
        assert moved["pid"] == stats[(death.server + 1) % servers]["pid"]  # its replica's server serves it
    how = "stopped responding" if death.point == "stop" else "was killed by SIGKILL"
    assert f"ps{death.server} (rank {death.server}) {how}" in err, err
    assert f"its shard is served by its replica on ps{(death.server + 1) % servers}" in err, err


@pytest.mark.timeout(120)
def test_a_second_server_death_fails_the_job_naming_both(launch):
    with pytest.raises(gradsync.JobFailed) as failed:
        launch(train, strategy="ps", workers=2, servers=2, timeout=100, replicas=1,
               args=((ServerDeath(1, 2, "pushed"), ServerDeath(0, 5, "pushed")), STEPS))
    assert failed.value.rank == 0
    assert str(failed.value).startswith("ps0 (rank 0) was killed by SIGKILL"), failed.value
    assert "after ps1 (rank 1) was killed by SIGKILL: with one replica per shard the job survives one server's " \
           "death, and now a shard has no copy left" in str(failed.value)
