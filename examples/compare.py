"""`make run`: train the digits example under both strategies and print them side by side."""
import argparse
import sys

import gradsync
from digits import train


def row(name: str, s: dict) -> str:
    ms = lambda key: f"{1000 * s[key]:.2f}"  # noqa: E731
    return (
        f"| {name} | {s['final_loss']:.3f} | {100 * s['test_accuracy']:.1f}% | {s['samples_per_s']:.0f} | "
        f"{ms('step_s')} | {ms('pull_s')} | {ms('compute_s')} | {ms('commit_s')} | "
        f"{s['bytes_sent'] / 1024:.0f} | {s['bytes_received'] / 1024:.0f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--mode", default="sync")
    parser.add_argument("--compression", default="none", help="none, fp16, bf16 or int8")
    parser.add_argument("--link", default=None, help="a tc rate (100mbit, 1gbit): each rank behind a link of that "
                        "rate, in its own network namespace (root and iproute2; default: loopback)")
    args = parser.parse_args()
    jobs = [
        (f"ps ({args.mode}, {args.servers} server{'s' * (args.servers > 1)})",
         dict(strategy="ps", servers=args.servers, mode=args.mode, compression=args.compression)),
        ("allreduce", dict(strategy="allreduce", servers=0, compression=args.compression)),
    ]
    lines = [
        f"digits, {args.workers} workers, {args.epochs} epochs, compression {args.compression}, "
        f"link {args.link or 'loopback'} "
        "(medians per step, worker 0)",
        "",
        "| strategy | final loss | test acc | samples/s | step ms | pull ms | compute ms | commit ms "
        "| sent KB/step | recv KB/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, settings in jobs:
        print(f"training with {name} ...", file=sys.stderr)
        summary = gradsync.launch(train, workers=args.workers, args=(args.epochs,), timeout=600, link=args.link,
                                  **settings)[0]
        lines.append(row(name, summary))
    print("\n".join(lines))
    print("\npull: waiting for parameters (ps; after the first step the last step's reply already holds them); "
          "compute: forward + backward; commit: trainer.step (ps: push the gradients, servers apply and reply with "
          "the next version; allreduce: local optimizer + buffer averaging).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
