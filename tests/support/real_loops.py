"""The training loops people write (parameter groups, schedules, clipping, accumulation, mixed precision,
checkpoints) as job functions for the tests, and their single-process references on the joint batch."""
from __future__ import annotations

import contextlib
import copy
import io

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn

import gradsync

VOCAB, DIM, WIDE, CLASSES, BATCH = 12, 8, 96, 5, 4
MAX_NORM = 0.05  # well below the gradient norms of this model: clipping bites on most steps


class Net(nn.Module):
    """Embedding, LayerNorm and a wide layer that a 2-server plan splits across the servers."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.wide = nn.Linear(DIM, WIDE)
        self.head = nn.Linear(WIDE, CLASSES)

    def forward(self, ids):
        return self.head(torch.tanh(self.wide(self.norm(self.emb(ids)).mean(1))))


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def groups(net: nn.Module, lr: float) -> list[dict]:
    """Weight decay on matrices at lr, none on biases, LayerNorm and the embedding at lr / 3."""
    decay = [p for n, p in net.named_parameters() if p.dim() == 2 and not n.startswith("emb")]
    rest = [p for n, p in net.named_parameters() if not (p.dim() == 2 and not n.startswith("emb"))]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": lr / 3}]


def batch(step: int, worker: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * worker + micro)
    return torch.randint(0, VOCAB, (BATCH, 3), generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def make_optimizer(kind: str, net: nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(groups(net, 3e-3), lr=3e-3)
    if kind == "sgd":
        return torch.optim.SGD(groups(net, 0.5), lr=0.5, momentum=0.9)
    if kind == "sign":
        return SignSGD([{"params": net.head.parameters(), "scale": 2.0},
                        {"params": [p for n, p in net.named_parameters() if not n.startswith("head")]}], lr=0.01)
    return torch.optim.SGD(net.parameters(), lr=0.5)  # "plain": what a table's exact row-wise form needs


def make_schedule(kind: str, optimizer: torch.optim.Optimizer, steps: int):
    if kind == "warmup":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    if kind == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[0.5, 0.2], total_steps=steps)
    if kind == "cosine":
        warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.2, total_iters=2)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
        return torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, cosine], milestones=[2])
    return None


def train(steps: int, optimizer_kind: str, schedule: str | None, max_norm: float | None, micro: int = 1,
          evaluate: bool = False, optimizer_state: bool = True) -> dict:
    """The user's loop under gradsync: returns the states, the norms, the optimizer state (unless not
    `optimizer_state`) and lr history."""
    net = make_net()
    optimizer = make_optimizer(optimizer_kind, net)
    trainer = gradsync.Trainer(net, optimizer, max_grad_norm=max_norm)
    scheduler = make_schedule(schedule, trainer.optimizer, steps)
    me, norms, lrs = gradsync.worker_rank(), [], []
    for step in range(steps):
        with dist_autograd.context() as cid:
            for m in range(micro):
                x, y = batch(step, me, m)
                dist_autograd.backward(cid, [F.cross_entropy(trainer.model(x), y) / micro])
            trainer.step(cid)
        norms.append(trainer.grad_norm)
        lrs.append([g["lr"] for g in trainer.optimizer.param_groups])
        if scheduler is not None:
            scheduler.step()
    out = {"norms": norms, "lrs": lrs, "optimizer": trainer.optimizer.state_dict() if optimizer_state else None,
           "module": {k: v.clone() for k, v in net.state_dict().items()}, "is_module": trainer.model.module is net}
    if evaluate:  # a forward outside any context, by the user's module and by trainer.model: changes nothing
        x, _ = batch(999, 0)
        with torch.no_grad():
            out["eval"] = (net(x), trainer.model(x))
    out["state"] = trainer.state_dict()
    return out


def reference(steps: int, workers: int, optimizer_kind: str, schedule: str | None, max_norm: float | None,
              micro: int = 1, per_worker: bool = False) -> dict:
    """Single-process training on the joint batch; `per_worker`: the same batch computed as the mean of the
    per-worker losses, whose distance to the joint one is the float noise of single-process training itself."""
    net = make_net()
    optimizer = make_optimizer(optimizer_kind, net)
    scheduler = make_schedule(schedule, optimizer, steps)
    norms = []
    for step in range(steps):
        optimizer.zero_grad()
        parts = [batch(step, w, m) for w in range(workers) for m in range(micro)]
        if per_worker:
            loss = sum(F.cross_entropy(net(x), y) for x, y in parts) / len(parts)
        else:
            loss = F.cross_entropy(net(torch.cat([x for x, _ in parts])), torch.cat([y for _, y in parts]))
        loss.backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return {"state": net.state_dict(), "norms": norms, "optimizer": optimizer.state_dict()}


def train_resumed(first: int, then: int, from_single_process: dict, load_before: bool) -> dict:
    """Continue a single-process run's model and AdamW state for `then` steps under gradsync (the state loaded
    into the user's optimizer before the Trainer, or through trainer.optimizer after it)."""
    from_single_process = copy.deepcopy(from_single_process)  # launch hands its ranks shared-memory tensors
    net = make_net()
    net.load_state_dict(from_single_process["state"])
    optimizer = make_optimizer("adamw", net)
    if load_before:
        optimizer.load_state_dict(from_single_process["optimizer"])
    trainer = gradsync.Trainer(net, optimizer)
    if not load_before:
        trainer.optimizer.load_state_dict(from_single_process["optimizer"])
    run_steps(trainer, range(first, first + then))
    return {"state": trainer.state_dict(), "optimizer": trainer.optimizer.state_dict()}


def continue_single_process(first: int, then: int, workers: int, state: dict, optimizer_state: dict) -> dict:
    """Single-process AdamW training on the joint batch from a model and optimizer state."""
    net = make_net()
    net.load_state_dict(state)
    optimizer = make_optimizer("adamw", net)
    optimizer.load_state_dict(copy.deepcopy(optimizer_state))  # as if saved: loading shares the tensors
    for step in range(first, first + then):
        optimizer.zero_grad()
        parts = [batch(step, w) for w in range(workers)]
        F.cross_entropy(net(torch.cat([x for x, _ in parts])), torch.cat([y for _, y in parts])).backward()
        optimizer.step()
    return {"state": net.state_dict(), "optimizer": optimizer.state_dict()}


def train_amp(steps: int, init_scale: float, dtype: torch.dtype, use_scaler: bool) -> dict:
    """Autocast around the forward, and the GradScaler's gradsync form; returns the state and scale history."""
    net = make_net()
    trainer = gradsync.Trainer(net, torch.optim.SGD(net.parameters(), lr=0.5), max_grad_norm=1.0 if use_scaler
                               else None)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2) if use_scaler else None
    me, scales = gradsync.worker_rank(), []
    for step in range(steps):
        x, y = batch(step, me)
        with dist_autograd.context() as cid:
            with torch.autocast("cpu", dtype=dtype):
                loss = F.cross_entropy(trainer.model(x), y)
            dist_autograd.backward(cid, [scaler.scale(loss) if use_scaler else loss])
            trainer.step(cid, scaler=scaler)
        scales.append(scaler.get_scale() if use_scaler else None)
    return {"state": trainer.state_dict(), "scales": scales, "dtypes": {p.dtype for p in net.parameters()}}


def reference_amp(steps: int, workers: int, init_scale: float, dtype: torch.dtype, use_scaler: bool) -> dict:
    """The GradScaler loop of torch's AMP recipe on one process, each worker's batch backward on its own
    (low-precision gradients overflow per worker's batch, as under DDP), then averaged."""
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2, enabled=use_scaler)
    scales = []
    for step in range(steps):
        optimizer.zero_grad()
        for w in range(workers):
            x, y = batch(step, w)
            with torch.autocast("cpu", dtype=dtype):
                loss = F.cross_entropy(net(x), y)
            scaler.scale(loss).backward()
        for p in net.parameters():
            p.grad /= workers
        if use_scaler:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale() if use_scaler else None)
    return {"state": net.state_dict(), "scales": scales}


def train_drive_apart(steps: int) -> None:
    """Worker 0 lowers its learning rate at step 1, worker 1 does not: the servers refuse the step, naming both."""
    net = make_net()
    trainer = gradsync.Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1))
    run_steps(trainer, range(1))
    trainer.optimizer.param_groups[0]["lr"] = 0.05 if gradsync.worker_rank() == 0 else 0.1
    run_steps(trainer, range(1, steps))


def misuse_the_step() -> dict:
    """Habits left from a DDP loop: the user's own optimizer's step(), and trainer.step after its context; what
    each said, and whether trainer.optimizer is the user's object."""
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    trainer = gradsync.Trainer(net, optimizer)
    said = {"same_object": trainer.optimizer is optimizer}
    try:
        optimizer.step()
    except RuntimeError as e:
        said["optimizer.step"] = str(e)
    with dist_autograd.context() as cid:
        x, y = batch(0, gradsync.worker_rank())
        dist_autograd.backward(cid, [F.cross_entropy(trainer.model(x), y)])
    try:
        trainer.step(cid)
    except RuntimeError as e:
        said["outside"] = str(e)
    return said


def optimizer_diff(a: dict, b: dict) -> float:
    """Largest difference between two optimizer state dicts of one layout (asserting the layout and options)."""
    assert [dict(g, params=None) for g in a["param_groups"]] == [dict(g, params=None) for g in b["param_groups"]]
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]
    assert sorted(a["state"]) == sorted(b["state"])
    worst = 0.0
    for i, state in a["state"].items():
        assert sorted(state) == sorted(b["state"][i])
        for k, v in state.items():
            other = b["state"][i][k]
            assert torch.is_tensor(v) == torch.is_tensor(other) and (not torch.is_tensor(v) or v.shape == other.shape)
            worst = max(worst, (v.double() - other.double()).abs().max().item() if torch.is_tensor(v)
                        else abs(v - other))
    return worst


def relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def noise_bound(noise: float) -> float:
    """What a gradsync result may differ from single-process training by, given that training's own noise."""
    return 10 * noise + 1e-6



class SignSGD(torch.optim.Optimizer):
    """A user's own optimizer class (not elementwise-listed: the servers keep its parameters whole)."""

    def __init__(self, params, lr: float = 0.01, scale: float = 1.0):
        super().__init__(params, dict(lr=lr, scale=scale))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"] * group["scale"])


def run_steps(trainer: gradsync.Trainer, steps: range, scheduler=None) -> None:
    """The plain loop on this worker's batches of `steps`."""
    me = gradsync.worker_rank()
    for step in steps:
        x, y = batch(step, me)
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [F.cross_entropy(trainer.model(x), y)])
            trainer.step(cid)
        if scheduler is not None:
            scheduler.step()


def train_tables(steps: int, optimizer_kind: str) -> dict:
    """A small embedding under tables='auto': served row by row with plain SGD (its lr following the warm-up),
    dense with AdamW."""
    net, said = make_net(), io.StringIO()
    with contextlib.redirect_stdout(said):
        trainer = gradsync.Trainer(net, make_optimizer(optimizer_kind, net))
    run_steps(trainer, range(steps), make_schedule("warmup", trainer.optimizer, steps))
    module = {k: v.clone() for k, v in net.state_dict().items()}
    return {"state": trainer.state_dict(), "tables": sorted(trainer.server_stats()[0]["tables"]),
            "said": said.getvalue(), "module": module}


def train_accumulating(steps: int, no_sync: bool) -> dict:
    """Two micro-batches per step, the first inside trainer.no_sync() when asked; counts DDP's allreduces."""
    net = make_net()
    trainer = gradsync.Trainer(net, make_optimizer("sgd", net))
    calls = []
    ddp = getattr(trainer.model, "ddp", None)
    if ddp is not None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp.register_comm_hook(None, lambda state, bucket: calls.append(1) or allreduce_hook(state, bucket))
    me = gradsync.worker_rank()
    for step in range(steps):
        with dist_autograd.context() as cid:
            with trainer.no_sync() if no_sync else contextlib.nullcontext():
                x, y = batch(step, me, 0)
                dist_autograd.backward(cid, [F.cross_entropy(trainer.model(x), y) / 2])
            x, y = batch(step, me, 1)
            dist_autograd.backward(cid, [F.cross_entropy(trainer.model(x), y) / 2])
            trainer.step(cid)
    return {"state": trainer.state_dict(), "allreduces": len(calls)}


def loader_batches(contexts: tuple[str, ...]) -> dict:
    """Every batch of one epoch from a DataLoader with worker processes of each start method in `contexts`
    (None: the DataLoader's default) and from one without workers, in a rank of a job."""
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(48.0).reshape(24, 2))
    loaders = {"none": DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))}
    for c in contexts:
        loaders[str(c)] = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1),
                                     num_workers=2, multiprocessing_context=c)
    return {name: [b[0] for b in loader] for name, loader in loaders.items()}
