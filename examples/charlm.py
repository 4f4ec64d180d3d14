"""Train a small GPT-style character language model with gradsync, the way such models are trained.

The text is Ambrose Bierce's "The Devil's Dictionary" (1911, public domain; shipped in examples/data).
The loop is a real one: AdamW with two parameter groups (weight decay on the matmul weights only), a
linear warm-up then cosine decay of the learning rate, gradient clipping at 1.0, and after every epoch
a loss on held-out text and a generated sample (rank 0 prints them). The strategy is a flag:
    gradsync run --strategy ps --workers 2 --servers 1 examples/charlm.py
    gradsync run --strategy allreduce --workers 2 examples/charlm.py
    gradsync run --strategy hybrid --workers 2 --servers 1 examples/charlm.py --row-tables
    python examples/charlm.py --reference 2    # one process, the joint batch of 2 workers: what sync training gives

The output head is untied from the token embedding: with a vocabulary of under 100 characters tying
would save about 5K parameters, and untied the embedding (no weight decay, as every embedding) and the
head (a matmul weight, decayed) each sit in the group that suits them.

AdamW has no row-wise form, so under ps the two embeddings stay dense (gradsync says so) and hybrid,
which serves tables row by row, refuses the model; --row-tables gives the embeddings gradsync.RowAdagrad
on the servers instead (a different optimizer for them, so no longer the single-process run's math).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import math
import os
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn

import gradsync
from progress import Progress

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "devils_dictionary.txt.gz")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Model size, data and schedule. The defaults train in seconds on a laptop core."""

    epochs: int = 3
    steps_per_epoch: int = 40
    batch: int = 16  # sequences per worker per step
    block: int = 64  # context length in characters
    n_embd: int = 64
    n_head: int = 4
    n_layer: int = 2
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the cosine decays to min_lr_ratio * lr
    warmup: int = 10  # steps of linear warm-up
    weight_decay: float = 0.1
    eval_windows: int = 128  # held-out windows, evenly spaced over the held-out text
    sample_chars: int = 200
    seed: int = 0
    row_tables: bool = False  # serve the embeddings row by row (gradsync.RowAdagrad): what --strategy hybrid needs


TINY = Settings(epochs=2, steps_per_epoch=6, batch=4, block=16, n_embd=16, n_head=2, warmup=3, eval_windows=16,
                sample_chars=40)  # for tests


# ---------------------------------------------------------------- data


class Corpus:
    """The text as character ids: the first 90% to train on, the last 10% held out."""

    def __init__(self, held_out: float = 0.1):
        with gzip.open(DATA, "rt", encoding="ascii") as f:
            text = f.read()
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([index[c] for c in text], dtype=torch.long)
        cut = int(len(ids) * (1 - held_out))
        self.train, self.val = ids[:cut], ids[cut:]

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())

    def shard(self, rank: int, workers: int) -> torch.Tensor:
        """Worker `rank`'s contiguous slice of the training text."""
        n = len(self.train)
        return self.train[rank * n // workers : (rank + 1) * n // workers]


def batches(data: torch.Tensor, batch: int, block: int, seed: int):
    """Endless (x, y) batches of `batch` random windows of `data`, y being x shifted by one character;
    the same arguments give the same batches in any process."""
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(block + 1)
    while True:
        windows = data[torch.randint(len(data) - block, (batch, 1), generator=generator) + offsets]
        yield windows[:, :-1], windows[:, 1:]


def worker_batches(corpus: Corpus, s: Settings, rank: int, workers: int):
    return batches(corpus.shard(rank, workers), s.batch, s.block, seed=1000 * s.seed + rank)


# ---------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        scores = q @ k.transpose(-2, -1) / math.sqrt(c // self.n_head)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attention = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.proj((attention @ v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention, then a 4x MLP, each around a residual."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """Token and position embeddings, `n_layer` blocks, a final LayerNorm and an (untied) output head."""

    def __init__(self, vocab: int, block: int, n_embd: int, n_head: int, n_layer: int):
        super().__init__()
        self.block = block
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(block, n_embd)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (batch, time, vocab) of the next character at every position."""
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return self.head(self.ln_f(self.blocks(x)))

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, n: int, generator: torch.Generator, temperature: float = 0.8):
        """`ids` followed by `n` sampled characters."""
        for _ in range(n):
            logits = self(ids[:, -self.block:])[:, -1] / temperature
            ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=generator)], dim=1)
        return ids


def make_model(s: Settings, vocab: int) -> CharGPT:
    torch.manual_seed(s.seed)
    return CharGPT(vocab, s.block, s.n_embd, s.n_head, s.n_layer)


def make_optimizer(model: nn.Module, s: Settings) -> torch.optim.AdamW:
    """AdamW with weight decay on the nn.Linear weights and none on biases, LayerNorm and embeddings."""
    matmul = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    decay = [p for p in model.parameters() if id(p) in matmul]
    rest = [p for p in model.parameters() if id(p) not in matmul]
    return torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.95))


def lr_factor(step: int, s: Settings) -> float:
    """The learning rate of `step` as a fraction of the peak: linear warm-up, then cosine decay."""
    if step < s.warmup:
        return (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.epochs * s.steps_per_epoch - s.warmup)
    return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def language_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model: nn.Module, corpus: Corpus, s: Settings) -> tuple[float, float]:
    """Mean loss and next-character accuracy over `s.eval_windows` windows evenly spaced over the held-out
    text."""
    starts = torch.linspace(0, len(corpus.val) - s.block - 1, s.eval_windows).long()
    windows = corpus.val[starts[:, None] + torch.arange(s.block + 1)]
    logits, y = model(windows[:, :-1]).flatten(0, 1), windows[:, 1:].flatten()
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


# ---------------------------------------------------------------- the loop


def fit(s: Settings, corpus: Corpus, net: CharGPT, optimizer, step, streams: list, talk: bool) -> dict:
    """The epochs shared by gradsync workers and the single-process reference. `step(parts)` trains on one
    batch from each of `streams` and returns (loss, grad norm before clipping); after each epoch the
    held-out loss and accuracy, and (where `talk`) a printed summary (the train loss of this process's own
    batches) and a generated sample."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, s=s))
    bar = Progress(s.epochs * s.steps_per_epoch, "training", enabled=talk)
    losses, norms, val_losses = [], [], []
    start = time.perf_counter()
    for epoch in range(s.epochs):
        for _ in range(s.steps_per_epoch):
            parts = [next(stream) for stream in streams]
            loss, norm = step(parts)
            scheduler.step()
            losses.append(loss)
            norms.append(norm)
            gradsync.log(loss=loss, samples=sum(len(x) for x, _ in parts))  # for gradsync compare
            bar.update(f"loss {loss:.3f}")
        val_loss, accuracy = evaluate(net, corpus, s)
        val_losses.append(val_loss)
        gradsync.log(val_loss=val_loss, acc=accuracy)
        if talk:
            prompt = torch.tensor([[corpus.chars.index("\n")]])
            sample = corpus.decode(net.generate(prompt, s.sample_chars, torch.Generator().manual_seed(epoch))[0])
            train_loss = sum(losses[-s.steps_per_epoch:]) / s.steps_per_epoch
            print(f"epoch {epoch + 1}: train loss {train_loss:.3f}, held-out loss {val_loss:.3f}, "
                  f"accuracy {accuracy:.3f}, lr {scheduler.get_last_lr()[0]:.2e}, sample:{sample}\n", flush=True)
    elapsed = time.perf_counter() - start
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return {"losses": losses, "norms": norms, "val_losses": val_losses, "accuracy": accuracy, "state": state,
            "seconds": elapsed}


def train(s: Settings = Settings()) -> dict:
    """What every gradsync worker runs: its own slice of the text, the shared model and optimizer."""
    me, workers = gradsync.worker_rank(), gradsync.num_workers()
    corpus = Corpus()
    net = make_model(s, len(corpus.chars))
    # AdamW has no row-wise form, so the embeddings stay dense unless a row optimizer is given for them
    rows = gradsync.RowAdagrad(lr=s.lr) if s.row_tables else None
    trainer = gradsync.Trainer(net, make_optimizer(net, s), max_grad_norm=1.0, table_optimizer=rows)

    def step(parts):
        (x, y), = parts
        with dist_autograd.context() as cid:
            loss = language_loss(trainer.model, x, y)
            dist_autograd.backward(cid, [loss])
            trainer.step(cid)
        return loss.item(), trainer.grad_norm

    # net is the user's module: after each step it holds the trained values under every strategy
    return fit(s, corpus, net, trainer.optimizer, step, [worker_batches(corpus, s, me, workers)], talk=me == 0)


def train_reference(s: Settings, workers: int, per_worker_losses: bool = False, talk: bool = False) -> dict:
    """The same training in one process without gradsync, each step on the joint batch of `workers` workers
    (their batches in rank order): what sync training under any strategy computes. `per_worker_losses`
    takes the mean of the workers' losses instead of one loss over the joint batch (the same math,
    different float rounding: the noise that a comparison with gradsync has to allow)."""
    corpus = Corpus()
    net = make_model(s, len(corpus.chars))
    optimizer = make_optimizer(net, s)

    def step(parts):
        optimizer.zero_grad()
        if per_worker_losses:
            loss = sum(language_loss(net, x, y) for x, y in parts) / len(parts)
        else:
            loss = language_loss(net, torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        return loss.item(), norm.item()

    streams = [worker_batches(corpus, s, w, workers) for w in range(workers)]
    return fit(s, corpus, net, optimizer, step, streams, talk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny model and run the tests use")
    for field in ("epochs", "steps_per_epoch", "batch", "block", "lr", "seed"):
        kind = type(getattr(Settings, field))
        parser.add_argument("--" + field.replace("_", "-"), type=kind, help=f"default {getattr(Settings, field)}")
    parser.add_argument("--row-tables", action="store_true", default=None,
                        help="ps and hybrid: serve the two embeddings row by row with gradsync.RowAdagrad (its lr "
                             "following the schedule) instead of AdamW; --strategy hybrid needs it")
    parser.add_argument("--reference", type=int, metavar="W",
                        help="train in this process, without gradsync, on the joint batch of W workers")
    args = parser.parse_args()
    given = {k: v for k, v in vars(args).items() if v is not None and hasattr(Settings, k)}
    s = dataclasses.replace(TINY if args.tiny else Settings(), **given)
    if args.reference and s.row_tables:
        parser.error("--reference trains the embeddings with AdamW: leave out --row-tables")
    if args.reference:
        result = train_reference(s, args.reference, talk=True)
        workers, rank = args.reference, 0
    else:
        gradsync.init()
        result = train(s)
        workers, rank = gradsync.num_workers(), gradsync.worker_rank()
    if rank == 0:
        steps = len(result["losses"])
        print(f"final train loss {sum(result['losses'][-s.steps_per_epoch:]) / s.steps_per_epoch:.3f}, "
              f"held-out loss {result['val_losses'][-1]:.3f}, accuracy {result['accuracy']:.3f}, "
              f"{workers * s.batch * s.block * steps / result['seconds']:.0f} characters/s")
    if not args.reference:
        gradsync.shutdown()


if __name__ == "__main__":
    main()
