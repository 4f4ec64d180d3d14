"""Achieved TCP throughput between two ranks of an emulated network (`gradsync.launcher.netem`) against its rate.

Rank 1 listens, rank 0 sends for SECONDS over one TCP connection (through rank 0's uplink, the bridge, and
rank 1's downlink); the receiver's byte count over the time after the first second (past TCP's slow start and
the first token-bucket burst) is the achieved rate. tbf meters whole frames: with a 1500-byte MTU a frame of
1514 bytes carries 1448 bytes of TCP payload, so a saturated link delivers 1448/1514 = 0.956 of its rate as
payload. Needs root and iproute2.

    PYTHONPATH=$PWD python bench/link.py [--rates 100mbit 1gbit 10gbit] [--seconds 5] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from gradsync.launcher.netem import Link, Network

RESULTS = os.path.join(os.path.dirname(__file__), "results", "link.json")
PORT = 5201
_CHUNK = 1 << 20


def receive(host: str, seconds: float, warmup: float) -> None:
    """Accept one connection and print the bytes per second received after `warmup` seconds."""
    import socket

    with socket.create_server((host, PORT)) as server:
        server.settimeout(30)
        conn, _ = server.accept()
        conn.settimeout(10)
        start = time.monotonic()
        counted, began = 0, None
        while True:
            data = conn.recv(_CHUNK)
            if not data:
                break
            now = time.monotonic()
            if now - start >= warmup:
                if began is None:
                    began = now
                else:
                    counted += len(data)
            if now - start >= seconds:
                break
        print(json.dumps({"bytes": counted, "seconds": time.monotonic() - began}))


def send(host: str, seconds: float) -> None:
    """Connect to `host` and send zeros for `seconds` (plus a margin)."""
    import socket

    payload = bytes(_CHUNK)
    for _ in range(100):  # the receiver may not listen yet
        try:
            conn = socket.create_connection((host, PORT), timeout=10)
            break
        except ConnectionRefusedError:
            time.sleep(0.05)
    else:
        raise RuntimeError(f"no receiver at {host}:{PORT}")
    deadline = time.monotonic() + seconds + 2
    try:
        while time.monotonic() < deadline:
            conn.sendall(payload)
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        conn.close()


def measure(rate: str, seconds: float) -> dict:
    link = Link.parse(rate)
    me = [sys.executable, __file__]
    with Network(link, 2) as net:
        receiver = subprocess.Popen(net.command(1, [*me, "--receive", str(seconds)]), stdout=subprocess.PIPE,
                                    text=True)
        sender = subprocess.Popen(net.command(0, [*me, "--send", Network.address(1), str(seconds)]))
        out, _ = receiver.communicate(timeout=seconds + 60)
        sender.wait(timeout=30)
    got = json.loads(out)
    achieved = got["bytes"] * 8 / got["seconds"]
    return {"link": rate, "configured_bit_s": link.bits_per_s, "achieved_bit_s": round(achieved),
            "ratio": round(achieved / link.bits_per_s, 3), "seconds": round(got["seconds"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit", "10gbit"])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3, help="runs of every rate, interleaved; the median is kept")
    parser.add_argument("--out", default=RESULTS, help=f"where to write the JSON report (default: {RESULTS})")
    parser.add_argument("--receive", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--send", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receive is not None:
        return receive(Network.address(1), args.receive, 1.0)
    if args.send:
        return send(args.send[0], float(args.send[1]))
    runs = [[measure(rate, args.seconds) for rate in args.rates] for _ in range(args.repeats)]  # interleaved
    rows = []
    for i, rate in enumerate(args.rates):
        ratios = [run[i]["ratio"] for run in runs]
        row = dict(sorted((run[i] for run in runs), key=lambda r: r["ratio"])[len(runs) // 2], ratios=ratios)
        rows.append(row)
        print(f"{rate:>8}: {row['achieved_bit_s'] / 1e6:9.1f} Mbit/s achieved (median of {len(runs)}), "
              f"{row['ratio']:.3f} of the configured rate (each run: {ratios})")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": shlex.join(["python", "bench/link.py", *sys.argv[1:]]), "nproc": os.cpu_count(),
                   "rows": rows}, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
