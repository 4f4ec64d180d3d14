"""A model with a fixed table, an LSTM, a dynamic table and a dense head, and one job that checks the user's
module stays an ordinary PyTorch module under the job's strategy: `torch.save` + `torch.load` and
`copy.deepcopy` give plain modules holding the trained values (whole tables included) that train on in one
process; `model.state_dict()` round-trips through `model.load_state_dict`; a single-process state loaded into
the running job goes where it is trained, and training again from it ends bit for bit where the first run
ended; a bad load changes nothing; after `gradsync.shutdown()` the module itself is plain."""
from __future__ import annotations

import copy
import io

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn

import gradsync

ROWS, DIM, LR, STEPS = 5000, 4, 0.1, 3


class TableNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(ROWS, DIM)
        self.rnn = nn.LSTM(DIM, DIM, batch_first=True)  # its class pickles its own state (`__getstate__`)
        self.tags = gradsync.DynamicEmbedding(DIM, capacity=6, mode="sum")
        self.head = nn.Linear(2 * DIM, 3)

    def forward(self, ids: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        sequence, _ = self.rnn(self.emb(ids))
        return self.head(torch.cat([sequence.mean(1), self.tags(tags)], 1))


def table_batch(step: int, worker: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 * step + worker)
    return (torch.randint(0, ROWS, (4, 5), generator=g), torch.randint(-2**40, 2**40, (4, 2), generator=g) % 9,
            torch.randint(0, 3, (4,), generator=g))


def _train(trainer: gradsync.Trainer, steps: int) -> None:
    me = gradsync.worker_rank()
    for step in range(steps):
        ids, tags, y = table_batch(step, me)
        with dist_autograd.context() as cid:
            loss = F.cross_entropy(trainer.model(ids, tags), y)
            dist_autograd.backward(cid, [loss])
            trainer.step(cid)


def _every_worker_here(name: str) -> None:
    """Wait until every worker has reached this point (the job's own barrier in its rendezvous store)."""
    from gradsync.membership.arrivals import wait_for_every_worker
    from gradsync.runtime import cluster

    store, key = cluster.current().store, f"plain_models/{name}"
    store.append(key, f"{gradsync.worker_rank()},")
    wait_for_every_worker(store, key, gradsync.num_workers(), 60,
                          lambda missing, arrived: TimeoutError(f"workers {missing} never reached {name!r}"))


def saved(module: nn.Module) -> bytes:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    return buffer.getvalue()


def attached(module: nn.Module) -> list[str]:
    """What of gradsync's is left on `module` and its submodules: instance attributes and hooks."""
    out = []
    for name, m in module.named_modules():
        out += [f"{name}.{k}" for k in ("forward", "served", "__reduce_ex__", "load_state_dict")
                if k in m.__dict__ and (k != "served" or m.__dict__[k] is not None)]
        out += [f"{name}.{k}" for k in ("_forward_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
                                        "_load_state_dict_post_hooks") if getattr(m, k)]
    return out


def plain_copies(module: nn.Module) -> dict:
    """A saved-and-loaded copy and a deep copy of `module`: their state dicts, what of gradsync's they hold, and
    whether the saved bytes name a gradsync module beyond the user's layer."""
    data = saved(module)
    loaded = torch.load(io.BytesIO(data), weights_only=False)
    copied = copy.deepcopy(module)
    trained = copy.deepcopy(copied)  # trains on in one process
    ids, tags, y = table_batch(99, 0)
    F.cross_entropy(trained(ids, tags), y).backward()
    with torch.no_grad():
        for p in trained.parameters():
            p -= LR * p.grad
    trained.tags.step(gradsync.RowSGD(lr=LR))
    return {"loaded": loaded.state_dict(), "copied": copied.state_dict(), "types": type(loaded).__name__,
            "attached": attached(loaded) + attached(copied), "trained_moved": bool(
                (trained.emb.weight != copied.emb.weight).any()),
            "names_internals": b"gradsync.worker" in data or b"gradsync.transport" in data}


def plain_module_job() -> dict:
    """The module checks (module docstring) on a worker; every worker loads alike, as under DDP."""
    model = TableNet()
    trainer = gradsync.Trainer(model, torch.optim.SGD(model.parameters(), lr=LR),
                               table_optimizer=gradsync.RowSGD(lr=LR))
    _train(trainer, STEPS)
    out = {"trained": trainer.state_dict(), "module_state": {k: v.clone() for k, v in model.state_dict().items()},
           **plain_copies(model)}
    state = model.state_dict()
    _every_worker_here("copied")  # a worker's load reaches the servers (sharded: its own rows) at once
    model.load_state_dict(state)
    _every_worker_here("round trip")
    out["round_trip"] = trainer.state_dict()
    bad = dict(out["trained"], **{"emb.weight": torch.zeros(ROWS + 1, DIM)})
    try:
        model.load_state_dict(bad)
    except RuntimeError as e:
        out["bad_load"] = str(e)
    out["after_bad_load"] = trainer.state_dict()
    _every_worker_here("read")
    fresh = TableNet().state_dict()
    model.head.load_state_dict({k[len("head."):]: v for k, v in fresh.items() if k.startswith("head.")})
    model.emb.load_state_dict({"weight": fresh["emb.weight"]})
    _every_worker_here("loaded parts")
    out["loaded_parts"] = trainer.state_dict()
    _every_worker_here("read parts")
    trainer.load_state_dict(fresh)
    _every_worker_here("loaded fresh")
    out["loaded_fresh"] = trainer.state_dict()
    _every_worker_here("loaded")  # a worker's next lookups create rows on the servers
    _train(trainer, STEPS)
    out["trained_again"] = trainer.state_dict()
    gradsync.shutdown()
    out["after_shutdown"] = {"state": model.state_dict(), "attached": attached(model),
                             "weight_is_parameter": isinstance(model.emb.weight, nn.Parameter),
                             "resident_rows": model.tags.resident_rows,
                             "names_internals": b"gradsync.worker" in saved(model)}
    return out


def dense_load_job() -> dict:
    """A dense model (any transport): trained, a single-process state loaded back, trained again from it, and a
    bad load refused changing nothing."""
    from jobs import make_mlp, run_loop

    model = make_mlp()
    trainer = gradsync.Trainer(model, torch.optim.SGD(model.parameters(), lr=LR))
    run_loop(trainer, STEPS)
    out = {"trained": trainer.state_dict(), "copied": copy.deepcopy(model).state_dict()}
    _every_worker_here("read")
    model.load_state_dict(make_mlp().state_dict())
    _every_worker_here("loaded")
    out["loaded"] = trainer.state_dict()
    try:
        model.load_state_dict({"0.weight": torch.zeros(1)}, strict=True)
    except RuntimeError as e:
        out["bad_load"] = str(e)
    out["after_bad_load"] = trainer.state_dict()
    _every_worker_here("read again")
    run_loop(trainer, STEPS)
    out["trained_again"] = trainer.state_dict()
    gradsync.shutdown()
    return out
