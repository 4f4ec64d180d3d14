"""replicas 1: every shard is kept on the next server too, a step is answered once both copies hold it, and when a
server dies its shard's replica serves it: the job ends bit for bit as without the death, wherever in the step the
server died."""
import pytest
import torch

from replicated import ServerDeath, train, train_clicks

pytestmark = pytest.mark.job

STEPS = 8
SHAPES = {  # function, servers, workers, its arguments after the death, the death
    "a push mid-step, two servers, three workers": (train, 2, 3, (STEPS,), ServerDeath(1, 3, "pushed")),
    "a clipped step held, three servers": (train, 3, 2, (STEPS, 0.5), ServerDeath(0, 4, "held")),
    "tables served by rows and a GradScaler, the step applied but unanswered": (
        train_clicks, 2, 2, (STEPS,), ServerDeath(0, 3, "closed")),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_job_ends_bit_for_bit_as_without_the_server_death(launch, shape, capfd):
    fn, servers, workers, args, death = SHAPES[shape]
    runs = {run: launch(fn, strategy="ps", workers=workers, servers=servers, timeout=200, replicas=1,
                        args=(None if run == "clean" else death, *args))
            for run in ("clean", "died")}
    err = capfd.readouterr().err
    for w, ((clean, _), (died, stats)) in enumerate(zip(runs["clean"], runs["died"])):
        assert clean.keys() == died.keys() and all(torch.equal(clean[k], died[k]) for k in clean), w
        moved = stats[death.server]
        assert moved["version"] == runs["clean"][w][1][death.server]["version"]
        assert moved["pid"] == stats[(death.server + 1) % servers]["pid"]  # its replica's server serves it
    assert f"ps{death.server} (rank {death.server}) was killed by SIGKILL" in err, err
    assert f"its shard is served by its replica on ps{(death.server + 1) % servers}" in err, err
