"""The user's optimizer as data: what the Trainer accepts and refuses, and the state dict's layout by name."""
import pytest
import torch
from torch import nn

from gradsync.core.buckets import Entry
from gradsync.core.optimizer_spec import (OptimizerSpec, as_optimizer, changed_options, join_state, split_state,
                                          state_by_name)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))


def test_the_class_form_builds_over_the_model_and_an_instance_is_taken_as_it_is():
    model = net()
    built = as_optimizer(model, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    assert [p for g in built.param_groups for p in g["params"]] == list(model.parameters())
    mine = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": [*model[1:].parameters()]}], lr=1e-3)
    assert as_optimizer(model, mine, {}) is mine


@pytest.mark.parametrize("make,error,match", [
    (lambda m: torch.optim.SGD([*m.parameters(), nn.Parameter(torch.zeros(5, 6))], lr=0.1), ValueError,
     r"group 0 holds a tensor of shape \(5, 6\) that is not a parameter of the model"),
    (lambda m: torch.optim.SGD(m[0].parameters(), lr=0.1), ValueError,
     r"leaves trainable parameters \['1.weight', '1.bias', '2.weight', '2.bias'\] out"),
    (lambda m: "adam", TypeError, r"must be a torch.optim.Optimizer instance .* got 'adam'"),
])
def test_an_optimizer_that_does_not_fit_the_model_is_refused_naming_what(make, error, match):
    model = net()
    with pytest.raises(error, match=match):
        as_optimizer(model, make(model), {})


def test_keyword_arguments_beside_an_instance_are_refused():
    model = net()
    with pytest.raises(TypeError, match=r"keyword arguments \['lr'\] with an optimizer instance"):
        as_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), {"lr": 0.2})


def test_a_frozen_parameter_may_stay_out_of_the_optimizer():
    model = net()
    model[0].weight.requires_grad_(False)
    mine = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    assert as_optimizer(model, mine, {}) is mine
    assert OptimizerSpec.of(mine, model).names == (("0.bias", "1.weight", "1.bias", "2.weight", "2.bias"),)


class NeedsExtra(torch.optim.SGD):
    def __init__(self, params, extra, lr=0.1):
        super().__init__(params, lr=lr)
        self.extra = extra


def test_a_class_the_servers_cannot_rebuild_is_refused_on_the_worker():
    model = net()
    spec = OptimizerSpec.of(NeedsExtra(model.parameters(), extra=1), model)
    with pytest.raises(TypeError, match=r"NeedsExtra cannot be rebuilt on the parameter servers .* missing 1 "
                                        r"required positional argument: 'extra'"):
        spec.check_buildable()


def test_the_servers_rebuild_every_group_with_its_options_even_where_they_hold_none_of_it():
    model = net()
    mine = torch.optim.AdamW([{"params": model[0].parameters(), "weight_decay": 0.1},
                              {"params": [*model[1:].parameters()], "weight_decay": 0.0, "lr": 1e-4}], lr=1e-3)
    spec = OptimizerSpec.of(mine, model)
    assert spec.names == (("0.weight", "0.bias"), ("1.weight", "1.bias", "2.weight", "2.bias"))
    piece = torch.zeros(3, requires_grad=True)
    rebuilt = spec.build([("2.weight", piece)])
    assert [len(g["params"]) for g in rebuilt.param_groups] == [0, 1]
    assert [(g["lr"], g["weight_decay"]) for g in rebuilt.param_groups] == [(1e-3, 0.1), (1e-4, 0.0)]
    assert type(rebuilt) is torch.optim.AdamW


def test_changed_options_are_what_a_schedule_set_since_the_last_send():
    model = net()
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": [*model[1:].parameters()]}], lr=0.1)
    sent = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    assert changed_options(opt.param_groups, sent) == {}
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)  # sets lr and adds initial_lr
    assert changed_options(opt.param_groups, sent) == {0: {"lr": 0.05, "initial_lr": 0.1},
                                                       1: {"lr": 0.05, "initial_lr": 0.1}}


def test_a_split_parameters_state_joins_and_splits_back_exactly():
    p = nn.Parameter(torch.randn(3, 4))
    opt = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.randn(3, 4)
    opt.step()
    whole = state_by_name(opt, {id(p): "w"})
    entries = [Entry("w", (3, 4), 0, 5, 0), Entry("w", (3, 4), 0, 7, 5)]
    pieces = split_state(whole, entries)
    assert set(pieces) == {"w[0:5]", "w[5:12]"} and pieces["w[5:12]"]["exp_avg"].shape == (7,)
    back = join_state(pieces, entries)
    assert set(back) == {"w"} and torch.equal(back["w"]["step"], whole["w"]["step"])
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(back["w"][key], whole["w"][key])
