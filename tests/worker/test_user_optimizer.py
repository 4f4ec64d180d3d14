"""The user's own optimizer object under a Trainer (`gradsync.worker.module.user_optimizer`), in one process: its step
runs only inside a trainer's step, LR schedulers built on it before or after still count each step, and a
clip_grad_norm_ left inside a dist_autograd context is named once."""
import warnings

import pytest
import torch
import torch.distributed.autograd as dist_autograd

from gradsync.core import torch_internals as ti
from gradsync.worker.module import user_optimizer
from gradsync.worker.module.user_optimizer import StepGuard


def _sgd():
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.full((2,), 0.5)
    return weight, torch.optim.SGD([weight], lr=0.1)


def test_the_step_runs_inside_a_trainers_step_only_and_names_the_fix_outside():
    weight, optimizer = _sgd()
    guard = StepGuard(optimizer)
    with pytest.raises(RuntimeError, match=r"call trainer.step\(context_id\).*not optimizer.step\(\)"):
        optimizer.step()
    assert torch.equal(weight.detach(), torch.ones(2))  # refused: nothing changed
    with guard.open():
        with guard.open():  # nested: still open after the inner block
            pass
        optimizer.step()
    assert torch.equal(weight.detach(), torch.full((2,), 0.95))
    with pytest.raises(RuntimeError):
        optimizer.step()


def test_a_guard_with_its_own_step_runs_that_instead():
    weight, optimizer = _sgd()
    ran = []
    guard = StepGuard(optimizer, lambda closure=None: ran.append(closure))
    with guard.open():
        optimizer.step()
    assert ran == [None] and torch.equal(weight.detach(), torch.ones(2))


@pytest.mark.parametrize("built", ["before", "after"])
def test_lr_schedulers_built_before_or_after_the_guard_follow_its_steps_without_a_warning(built):
    _, optimizer = _sgd()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "optimizer.step() has been overridden" / "lr_scheduler.step() before"
        if built == "before":
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
        guard = StepGuard(optimizer)
        if built == "after":
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
        lrs = []
        for _ in range(3):
            with guard.open():
                optimizer.step()
            scheduler.step()
            lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.1 / 2, 0.1 / 3, 0.1 / 4])


def test_a_clip_grad_norm_left_inside_a_context_is_named_once_with_the_fix(monkeypatch, capsys):
    ti.start_dist_autograd(0)
    monkeypatch.setattr(user_optimizer, "_watching", [])
    weight, _ = _sgd()
    user_optimizer.watch_clipping(say=True)
    torch.nn.utils.clip_grad_norm_([weight], 1.0)  # outside a context: a plain loop's, said nothing
    with dist_autograd.context():
        with StepGuard(torch.optim.SGD([weight], lr=0.1)).open():  # gradsync's own clipping, inside its step
            torch.nn.utils.clip_grad_norm_([weight], 1.0)
        assert capsys.readouterr().err == ""
        for _ in range(2):
            torch.nn.utils.clip_grad_norm_([weight], 1.0)
    err = capsys.readouterr().err
    assert err.count("clip_grad_norm_ was called inside a dist_autograd context") == 1
    assert "max_grad_norm=" in err


def test_a_worker_other_than_the_first_says_nothing_of_clipping(monkeypatch, capsys):
    ti.start_dist_autograd(0)
    monkeypatch.setattr(user_optimizer, "_watching", [])
    weight, _ = _sgd()
    user_optimizer.watch_clipping(say=False)
    with dist_autograd.context():
        torch.nn.utils.clip_grad_norm_([weight], 1.0)
    assert capsys.readouterr().err == ""
