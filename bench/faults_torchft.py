"""What one worker's death costs torchft 0.2.0: the outside baseline of the fault benchmark (CPU, gloo, loopback).

A fixed workload: Linear(512,1024)-ReLU-Linear(1024,512)-ReLU-Linear(512,10) after torch.manual_seed(0)
(1,055,242 parameters), AdamW(lr=1e-3), W=2 replicas (a process and a replica group each) under torchft's
Lighthouse, Manager (state_dict/load_state_dict for healing, PGTransport as in torchft's train_ddp.py),
DistributedDataParallel and OptimizerWrapper over ProcessGroupGloo. Worker w's batch at step s is seeded
1000*s + w (64 x 512 randn, 64 labels in 0..9), cross-entropy; each step sleeps --compute-s before its forward.

Scenarios: none; between (worker 1 SIGKILLs itself at the start of step --kill-at, before its forward); mid
(worker 1 SIGKILLs itself inside the backward of step --kill-at, from a hook on the first layer's weight grad).
This main process (the driver) starts the lighthouse, hosts each replica group's TCPStore (as torchrun would),
starts the workers, and restarts every worker that dies, --restart-delay s after it saw the death (the
replacement heals from a live replica through torchft). The run ends when both workers reach --steps
(torchft's step counter). Each worker writes a JSON line per step (step, committed, participants, t).

Output, the last line of stdout (and --out): wall seconds from the workers' start to the end, the steps each
worker committed, dropped batches (W - participants at each step's last commit, plus one per failed commit;
torchft's own batches_committed beside it), steps redone after a rollback (when no replica kept the state),
the stall (longest time with no commit), deaths/crashes with exit code and stderr tail, restarts, and the
sha256 of the final parameters. Everything listens on 127.0.0.1 only: the lighthouse gets --bind, the stores
a socket bound there, gloo GLOO_SOCKET_IFNAME=lo, and torchft's ManagerServer (whose bind Manager hard-codes
as [::]:port) is handed 127.0.0.1:0 by a wrapper.

    /work/ftvenv/bin/python bench/faults_torchft.py [--scenario none|between|mid] [--steps 150] [--kill-at 60]
        [--compute-s 0.15] [--restart-delay 1.0] [--heartbeat-timeout-ms 5000] [--timeout 600] [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

W = 2
os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, in the driver and (via env) each worker


def read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by SIGKILL
            pass
    return out


def worker(a: argparse.Namespace) -> None:
    import hashlib

    import torch
    import torchft.manager
    from torch import nn
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    real_server = torchft.manager.ManagerServer

    def loopback_server(**kw: object) -> object:  # Manager passes bind=f"[::]:{port}", with no way to change it
        return real_server(**{**kw, "bind": "127.0.0.1:0"})

    torchft.manager.ManagerServer = loopback_server
    torch.set_num_threads(1)
    w, inc, run = a.worker, a.incarnation, Path(a.run_dir)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    manager = Manager(
        pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"bench_{w}", rank=0, world_size=1, store_addr="127.0.0.1", store_port=a.store_port,
        lighthouse_addr=a.lighthouse, hostname="127.0.0.1", timeout=timedelta(seconds=30),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu")),
    )
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    loss_fn = nn.CrossEntropyLoss()
    doomed = w == 1 and inc == 0 and a.scenario != "none"
    if doomed and a.scenario == "mid":
        def die_in_backward(grad: torch.Tensor) -> None:
            if manager.current_step() == a.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        model[0].weight.register_hook(die_in_backward)
    if inc == 0:  # both first workers up before the first quorum, so step 0 has both
        (run / f"ready.{w}").touch()
        t_end = time.time() + 60
        while not all((run / f"ready.{v}").exists() for v in range(W)):
            if time.time() > t_end:
                sys.exit("the other worker never came up")
            time.sleep(0.02)
    log = open(run / f"w{w}.{inc}.jsonl", "a", buffering=1)
    while manager.current_step() < a.steps:
        data_step = manager.current_step()
        if doomed and a.scenario == "between" and data_step == a.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()  # starts the (async) quorum
        time.sleep(a.compute_s)
        g = torch.Generator().manual_seed(1000 * data_step + w)
        x = torch.randn(64, 512, generator=g)
        y = torch.randint(0, 10, (64,), generator=g)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        step, n = manager.current_step(), manager.num_participants()  # a healing replica's step is set by now
        opt.step()
        committed = manager.current_step() == step + 1
        log.write(json.dumps({"step": step, "committed": committed, "participants": n, "t": time.time(),
                              "loss": round(loss.item(), 5), "healed": step != data_step}) + "\n")
    state = model.state_dict()  # hashed as bench/faults_job.py hashes gradsync's: tensors in sorted key order
    digest = hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()
    log.write(json.dumps({"done": True, "step": manager.current_step(), "t": time.time(), "sha256": digest,
                          "batches_committed": manager.batches_committed()}) + "\n")
    log.close()
    manager.shutdown(wait=False)
    os._exit(0)


def driver(a: argparse.Namespace) -> dict:
    import torch.distributed as dist

    run = Path(a.run_dir or tempfile.mkdtemp(prefix="faults-torchft-"))
    run.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    procs: list[subprocess.Popen] = []
    lh_log = run / "lighthouse.log"
    lighthouse = subprocess.Popen(
        [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1", "--bind", "127.0.0.1:0",
         "--heartbeat_timeout_ms", str(a.heartbeat_timeout_ms)],
        stdout=lh_log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    procs.append(lighthouse)
    live: dict[int, tuple[int, subprocess.Popen]] = {}
    try:
        t_end = time.time() + 30
        while not (m := re.search(r"listening on: http://[^:]+:(\d+)", lh_log.read_text())):
            if time.time() > t_end or lighthouse.poll() is not None:
                raise RuntimeError(f"lighthouse did not start: {lh_log.read_text()[-2000:]}")
            time.sleep(0.05)
        lighthouse_addr = f"http://127.0.0.1:{m.group(1)}"
        stores = []
        for _ in range(W):  # one TCPStore per replica group, bound to loopback, outliving its workers
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(128)
            port = sock.getsockname()[1]
            stores.append((sock, dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                               master_listen_fd=sock.fileno()), port))

        def start(w: int, inc: int) -> None:
            cmd = [sys.executable, __file__, "--worker", str(w), "--incarnation", str(inc), "--run-dir", str(run),
                   "--store-port", str(stores[w][2]), "--lighthouse", lighthouse_addr, "--scenario", a.scenario,
                   "--steps", str(a.steps), "--kill-at", str(a.kill_at), "--compute-s", str(a.compute_s)]
            p = subprocess.Popen(cmd, stdout=(run / f"w{w}.{inc}.out").open("w"),
                                 stderr=(run / f"w{w}.{inc}.err").open("w"), env=env, start_new_session=True)
            procs.append(p)
            live[w] = (inc, p)

        t0 = time.time()
        for w in range(W):
            start(w, 0)
        deaths, pending, done, timed_out = [], {}, {}, False
        while live or pending:
            now = time.time()
            if now - t0 > a.timeout:
                timed_out = True
                break
            for w, (inc, p) in list(live.items()):
                if (rc := p.poll()) is None:
                    continue
                del live[w]
                lines = read_lines(run / f"w{w}.{inc}.jsonl")
                if rc == 0 and lines and lines[-1].get("done"):
                    done[w] = lines[-1]
                    continue
                err = (run / f"w{w}.{inc}.err").read_text().strip().splitlines()
                planned = w == 1 and inc == 0 and a.scenario != "none" and rc == -signal.SIGKILL
                deaths.append({"worker": w, "incarnation": inc, "rc": rc, "t": round(now - t0, 3),
                               "planned_kill": planned, "last_step": lines[-1]["step"] if lines else None,
                               "stderr_tail": [] if planned else err[-8:]})
                print(f"[driver] worker {w}.{inc} exited rc={rc} at {now - t0:.2f}s", file=sys.stderr)
                pending[w] = (inc + 1, now + a.restart_delay)
            for w, (inc, at) in list(pending.items()):
                if now >= at:
                    del pending[w]
                    start(w, inc)
            time.sleep(0.05)
        return summarize(a, run, t0, deaths, done, timed_out)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait(timeout=10)


def summarize(a: argparse.Namespace, run: Path, t0: float, deaths: list, done: dict, timed_out: bool) -> dict:
    logs = {w: [r for f in sorted(run.glob(f"w{w}.*.jsonl"), key=lambda f: int(f.name.split(".")[1]))
                for r in read_lines(f) if not r.get("done")] for w in range(W)}
    commits = sorted((r for w in range(W) for r in logs[w] if r["committed"]), key=lambda r: r["t"])
    final: dict[int, int] = {}  # step -> participants at its last commit: the lineage that finished
    for r in commits:
        final[r["step"]] = r["participants"]
    failed = {w: sum(not r["committed"] for r in logs[w]) for w in range(W)}

    def redone(rows: list) -> int:  # commits of a step this worker slot had already passed: a rollback
        top, n = -1, 0
        for r in (r for r in rows if r["committed"]):
            n, top = n + (r["step"] <= top), max(top, r["step"])
        return n

    times = [r["t"] for r in commits]
    steady = [r["t"] for r in logs[0] if r["committed"] and (not deaths or r["t"] - t0 < deaths[0]["t"])]
    kill = next((d for d in deaths if d["planned_kill"]), None)
    rejoin = next((round(r["t"] - t0 - kill["t"], 3) for r in commits
                   if kill and r["t"] - t0 > kill["t"] and r["participants"] == W), None)
    hashes = {d["sha256"] for d in done.values()}
    return {
        "scenario": a.scenario, "steps": a.steps, "kill_at": a.kill_at if a.scenario != "none" else None,
        "compute_s": a.compute_s, "restart_delay_s": a.restart_delay, "heartbeat_timeout_ms": a.heartbeat_timeout_ms,
        "wall_s": round(max(d["t"] for d in done.values()) - t0, 3) if len(done) == W else None,
        "first_step_s": round(times[0] - t0, 3) if times else None,  # startup: imports, stores, first quorum
        "finished": sorted(done), "timed_out": timed_out,
        "committed_steps": {str(w): sum(r["committed"] for r in logs[w]) for w in range(W)},
        "final_step": {str(w): done[w]["step"] if w in done else None for w in range(W)},
        "failed_commits": {str(w): failed[w] for w in range(W)},
        "short_steps": sorted(s for s, n in final.items() if n < W),
        # batches missing from the finished lineage's steps, plus batches computed and discarded by a failed commit
        "dropped": sum(W - n for n in final.values()) + sum(failed.values()),
        "torchft_batches_committed": done[0]["batches_committed"] if 0 in done else None,
        "steps_redone": max(redone(logs[w]) for w in range(W)),
        "median_step_s": round(statistics.median(b - x for x, b in zip(steady, steady[1:])), 3)
        if len(steady) > 1 else None,
        "stall_s": round(max(b - x for x, b in zip(times, times[1:])), 3) if len(times) > 1 else None,
        "back_to_w_replicas_s": rejoin,
        "crashed": any(not d["planned_kill"] for d in deaths),
        "deaths": deaths, "restarts": len(deaths),
        "sha256": next(iter(hashes)) if len(hashes) == 1 else sorted(hashes),
        "run_dir": str(run),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=["none", "between", "mid"], default="none")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--kill-at", type=int, default=60)
    ap.add_argument("--compute-s", type=float, default=0.15)
    ap.add_argument("--restart-delay", type=float, default=1.0)
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=5000, help="the lighthouse's (torchft's default)")
    ap.add_argument("--timeout", type=float, default=600.0, help="the whole run's, from the workers' start")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--run-dir", help="where the logs go (default: a new temporary folder)")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--incarnation", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        worker(a)
        return
    result = driver(a)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
