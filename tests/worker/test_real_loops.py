"""Real training loops under every strategy against single-process training on the joint batch: the user's
optimizer with parameter groups, LR schedules, clipping, accumulation, optimizer state dicts, mixed precision,
and the user's module holding the trained values."""
import math

import pytest
import torch

import gradsync
from helpers import max_diff
from real_loops import (MAX_NORM, misuse_the_step, train_accumulating, continue_single_process, noise_bound,
                        optimizer_diff, reference, train_drive_apart,
                        reference_amp, relative, train, train_amp, train_resumed, train_tables)

STEPS = 8


@pytest.mark.job
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,servers,workers", [("ps", 1, 2), ("ps", 2, 4), ("allreduce", 0, 4)])
def test_adamw_groups_warmup_clipping_and_accumulation_match_single_process(launch, strategy, servers, workers):
    args = (STEPS, "adamw", "warmup", MAX_NORM, 2, True)
    results = launch(train, strategy=strategy, workers=workers, servers=servers, args=args, timeout=280)
    joint = reference(STEPS, workers, "adamw", "warmup", MAX_NORM, micro=2)
    noise = max_diff(joint["state"], reference(STEPS, workers, "adamw", "warmup", MAX_NORM, 2, True)["state"])
    assert sum(n > MAX_NORM for n in joint["norms"]) >= STEPS - 1  # the clipping bites
    for r in results:
        assert relative(r["norms"], joint["norms"]) <= 1e-5
        assert max_diff(r["state"], joint["state"]) <= noise_bound(noise)
        assert optimizer_diff(r["optimizer"], joint["optimizer"]) <= noise_bound(noise)
        assert max_diff(r["state"], results[0]["state"]) == 0.0
        assert r["lrs"][0] == pytest.approx([1e-3, 1e-3 / 3]) and r["lrs"][-1] == pytest.approx([3e-3, 1e-3])
        assert r["is_module"] and max_diff(r["module"], r["state"]) == 0.0  # the user's module is trained
        mine, through_trainer = r["eval"]
        assert torch.equal(mine, through_trainer)
    assert max_diff(results[0]["state"], reference(0, workers, "adamw", None, None)["state"]) > 1e-2


@pytest.mark.job
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,servers,mode,workers,schedule", [
    ("ps", 2, "sync", 2, "onecycle"), ("allreduce", 0, "sync", 2, "onecycle"), ("ps", 2, "async", 1, "onecycle"),
    ("ps", 1, "ssp", 1, "cosine"),
])
def test_schedules_and_clipping_reach_every_server_exactly_with_sgd(launch, strategy, servers, mode, workers, schedule):
    """SGD with momentum is exact to float rounding; async and ssp with one worker are sync training."""
    results = launch(train, strategy=strategy, workers=workers, servers=servers, mode=mode,
                     args=(STEPS, "sgd", schedule, MAX_NORM), timeout=280)
    joint = reference(STEPS, workers, "sgd", schedule, MAX_NORM)
    for r in results:
        assert max_diff(r["state"], joint["state"]) <= 1e-5
        assert relative(r["norms"], joint["norms"]) <= 1e-5
        assert optimizer_diff(r["optimizer"], joint["optimizer"]) <= 1e-5
    assert len({tuple(map(tuple, r["lrs"])) for r in results}) == 1 and results[0]["lrs"][0] != results[0]["lrs"][-1]


@pytest.mark.job
@pytest.mark.timeout(300)
@pytest.mark.parametrize("pipeline", ["on", "off"])
def test_a_schedule_without_clipping_matches_single_process_in_pieces_and_in_whole_steps(launch, pipeline):
    """The two sync ps steps a job may plan (`worker.pipeline.piece_size.step_plan`): the options a scheduler changes
    travel with the pieces' head, or with the whole push."""
    results = launch(train, strategy="ps", workers=2, servers=2, pipeline=pipeline,
                     args=(STEPS, "sgd", "onecycle", None), timeout=280)
    joint = reference(STEPS, 2, "sgd", "onecycle", None)
    for r in results:
        assert max_diff(r["state"], joint["state"]) <= 1e-5
        assert optimizer_diff(r["optimizer"], joint["optimizer"]) <= 1e-5
    assert len({tuple(map(tuple, r["lrs"])) for r in results}) == 1 and results[0]["lrs"][0] != results[0]["lrs"][-1]


@pytest.mark.job
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,servers,load_before", [("ps", 2, True), ("ps", 2, False), ("allreduce", 0, False)])
def test_optimizer_state_dicts_move_between_single_process_and_gradsync(launch, strategy, servers, load_before):
    """3 steps in one process, 3 under gradsync from its state dicts, 2 more in one process from gradsync's:
    the same as 8 steps in one process."""
    workers = 2
    first = reference(3, workers, "adamw", None, None)
    middle = launch(train_resumed, strategy=strategy, workers=workers, servers=servers,
                    args=(3, 3, first, load_before), timeout=280)[0]
    joint = continue_single_process(3, 3, workers, first["state"], first["optimizer"])
    noise = max_diff(joint["state"], reference(6, workers, "adamw", None, None, per_worker=True)["state"])
    assert max_diff(middle["state"], joint["state"]) <= noise_bound(noise)
    assert optimizer_diff(middle["optimizer"], joint["optimizer"]) <= noise_bound(noise)
    last = continue_single_process(6, 2, workers, middle["state"], middle["optimizer"])
    assert max_diff(last["state"], continue_single_process(6, 2, workers, joint["state"], joint["optimizer"])["state"]
                    ) <= noise_bound(noise)


@pytest.mark.job
@pytest.mark.timeout(300)
@pytest.mark.parametrize("servers", [2])
def test_hybrid_clips_by_the_norm_of_dense_layers_and_served_rows_together(launch, servers):
    """Plain SGD serves the embedding row by row under hybrid (its lr following the warm-up); the norm that
    clips is the joint one, the servers' averaged rows included (two servers: the norm sums two shards'
    rows; hybrid with one server trains under bfloat16 below)."""
    results = launch(train, strategy="hybrid", workers=2, servers=servers,
                     args=(STEPS, "plain", "warmup", MAX_NORM, 1, False, False), timeout=280)
    joint = reference(STEPS, 2, "plain", "warmup", MAX_NORM)
    for r in results:
        assert max_diff(r["state"], joint["state"]) <= 1e-5
        assert relative(r["norms"], joint["norms"]) <= 1e-5
        assert max_diff(r["module"], r["state"]) == 0.0  # the served table too, gathered by net.state_dict()


@pytest.mark.job
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,servers,transport", [("ps", 2, "rpc"), ("ps", 2, "grpc"), ("allreduce", 0, "rpc"),
                                                        ("hybrid", 2, "rpc")])
def test_grad_scaler_skips_overflowing_steps_everywhere_and_backs_off_like_single_process(launch, strategy, servers,
                                                                                          transport):
    """fp16 autocast with a scale large enough that some steps overflow: every worker and server skips them
    and the scale backs off, or grows after good steps, as torch's GradScaler loop does."""
    args = (STEPS, 2.0**16, torch.float16, True)
    results = launch(train_amp, strategy=strategy, workers=2, servers=servers, args=args, timeout=280,
                     transport=transport)
    single = reference_amp(STEPS, 2, *args[1:])
    scales = single["scales"]
    assert any(b < a for a, b in zip(scales, scales[1:])) and any(b > a for a, b in zip(scales, scales[1:]))
    for r in results:
        assert r["scales"] == single["scales"]
        assert r["dtypes"] == {torch.float32}
        assert max_diff(r["state"], single["state"]) <= 2e-3  # fp16 rounding of a batch split in two
    assert max_diff(results[0]["state"], reference_amp(0, 2, *args[1:])["state"]) > 1e-2


@pytest.mark.job
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,servers", [("ps", 2), ("allreduce", 0), ("hybrid", 1)])
def test_bfloat16_autocast_trains_fp32_parameters_under_every_strategy(launch, strategy, servers):
    args = (STEPS, 1.0, torch.bfloat16, False)
    results = launch(train_amp, strategy=strategy, workers=2, servers=servers, args=args, timeout=280)
    single = reference_amp(STEPS, 2, *args[1:])
    for r in results:
        assert r["dtypes"] == {torch.float32}
        assert max_diff(r["state"], single["state"]) <= 2e-2  # bf16 rounding of a batch split in two
    assert max_diff(results[0]["state"], reference_amp(0, 2, *args[1:])["state"]) > 0.1


def test_noise_bound_is_not_vacuous():
    """The Adam-family bound: the float noise of single-process training is small but not zero here."""
    joint = reference(STEPS, 2, "adamw", "warmup", MAX_NORM, micro=2)
    noise = max_diff(joint["state"], reference(STEPS, 2, "adamw", "warmup", MAX_NORM, 2, True)["state"])
    assert noise_bound(noise) < 1e-3 and math.isfinite(noise)


@pytest.mark.job
@pytest.mark.timeout(300)
def test_a_users_own_optimizer_class_with_groups_runs_on_the_servers(launch):
    result = launch(train, strategy="ps", workers=2, servers=2, args=(4, "sign", None, None), timeout=280)[0]
    assert max_diff(result["state"], reference(4, 2, "sign", None, None)["state"]) <= 1e-6
    assert optimizer_diff(result["optimizer"], reference(4, 2, "sign", None, None)["optimizer"]) == 0.0
    assert max_diff(result["state"], reference(0, 2, "sign", None, None)["state"]) > 1e-2


@pytest.mark.job
@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer_kind,served", [("plain", ["emb.weight"]), ("adamw", [])])
def test_tables_are_served_only_where_a_row_optimizer_applies(launch, optimizer_kind, served):
    result, other = launch(train_tables, strategy="ps", workers=2, servers=2, args=(STEPS, optimizer_kind),
                           timeout=280)
    joint = reference(STEPS, 2, optimizer_kind, "warmup", None)
    noise = max_diff(joint["state"], reference(STEPS, 2, optimizer_kind, "warmup", None, per_worker=True)["state"])
    assert result["tables"] == served
    assert max_diff(result["state"], joint["state"]) <= noise_bound(noise)
    assert max_diff(result["module"], result["state"]) == 0.0  # a served table is in the module's state_dict
    # the table is 7% of the model: not worth a line (`WORTH_SERVING_SHARE`; test_tables says it for a larger one)
    assert "stays in the dense path" not in result["said"] and other["said"] == ""


@pytest.mark.job
@pytest.mark.timeout(120)
def test_a_schedule_that_differs_between_workers_is_refused_naming_both(launch):
    with pytest.raises(gradsync.JobFailed,
                       match=r"worker 0 changed 'lr' of optimizer group 0 to 0.05 and worker 1 not at all"):
        launch(train_drive_apart, strategy="ps", workers=2, servers=1, args=(3,), timeout=110)


@pytest.mark.job
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,servers", [("ps", 1), ("allreduce", 0)])
def test_the_users_optimizer_is_the_trainers_and_a_misplaced_step_says_where_it_belongs(launch, strategy, servers):
    said = launch(misuse_the_step, strategy=strategy, workers=1, servers=servers, timeout=110)[0]
    assert said["same_object"] is True
    assert "call trainer.step(context_id)" in said["optimizer.step"] and "not optimizer.step()" in said["optimizer.step"]
    assert said["outside"].startswith("trainer.step(") and "outside its dist_autograd context" in said["outside"]
    assert "Could not find autograd context" not in said["outside"]


@pytest.mark.job
@pytest.mark.timeout(300)
def test_schedules_clipping_and_optimizer_state_over_the_grpc_transport(launch):
    results = launch(train, strategy="ps", workers=2, servers=2, transport="grpc",
                     args=(STEPS, "adamw", "warmup", MAX_NORM), timeout=280)
    joint = reference(STEPS, 2, "adamw", "warmup", MAX_NORM)
    noise = max_diff(joint["state"], reference(STEPS, 2, "adamw", "warmup", MAX_NORM, per_worker=True)["state"])
    for r in results:
        assert max_diff(r["state"], joint["state"]) <= noise_bound(noise)
        assert relative(r["norms"], joint["norms"]) <= 1e-5
        assert optimizer_diff(r["optimizer"], joint["optimizer"]) <= noise_bound(noise)


@pytest.mark.job
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,servers", [("allreduce", 0), ("ps", 1)])
def test_no_sync_accumulates_without_an_exchange_per_backward(launch, strategy, servers):
    joint = reference(3, 2, "sgd", None, None, micro=2)["state"]
    plain, quiet = (launch(train_accumulating, strategy=strategy, workers=2, servers=servers,
                           args=(3, no_sync), timeout=280)[0] for no_sync in (False, True))
    assert max_diff(plain["state"], joint) <= 1e-5 and max_diff(quiet["state"], joint) <= 1e-5
    if strategy == "allreduce":  # one bucket for this small model: one allreduce per backward, or per step
        assert plain["allreduces"] == 6 and quiet["allreduces"] == 3
