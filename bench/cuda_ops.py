"""Bandwidth of the cuda_ops kernels against the plain PyTorch way, on one NVIDIA GPU.

For each op: median time over repeated runs (CUDA events), achieved bandwidth
(bytes read + written / time), that bandwidth as a percentage of a same-size
device copy measured in the same run, and the speedup over the plain PyTorch
way of computing the same thing. Inputs are at least --mb MB each (default
256). Writes JSON to bench/results/cuda_ops-<device>.json and prints a
markdown table.

    python bench/cuda_ops.py              # on a GPU machine
    python bench/cuda_ops.py --smoke      # tiny sizes on CPU, through the reference path
    python bench/cuda_ops.py --sweep      # each op against `reference` on the GPU, 64K to 64M elements

`--sweep` finds the crossover: below which input size the plain-PyTorch
`reference` (the same arithmetic, bit for bit) beats the Triton kernel, and
where a small call's time goes (the op's dispatcher, the Triton launch).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import platform
import re
import statistics
import sys
import time

import torch

from gradsync.cuda_ops import (
    aggregate,
    compress,
    compress_int8,
    decompress,
    dequantize_aggregate,
    reference,
)

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256, help="size of each fp32 input in MB (default 256)")
    p.add_argument("--workers", type=int, default=8, help="K, the number of gradients reduced (default 8)")
    p.add_argument("--reps", type=int, default=20, help="timed runs per measurement; the median is reported")
    p.add_argument("--block-size", type=int, default=256, help="int8 block size (default 256)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (reference path): checks the script")
    p.add_argument("--sweep", action="store_true", help="each op against reference at 64K..64M elements")
    p.add_argument("--out", type=pathlib.Path, help="JSON path (default bench/results/cuda_ops-<device>.json)")
    return p.parse_args(argv)


def timed_ms(fn, reps: int, device: str) -> float:
    """Median wall time of fn() in ms after one warm-up call (which also compiles the kernels)."""
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cases(n: int, k: int, block: int, device: str):
    """(op, dtype, bytes moved, our call, {baseline name: plain PyTorch call})."""
    g = torch.Generator(device=device).manual_seed(0)
    fp32 = [torch.randn(n, device=device, generator=g) for _ in range(k)]
    bf16 = [x.bfloat16() for x in fp32]
    s = 1.0 / k

    def add_chain(xs, out_dtype):
        acc = xs[0].float().clone()
        for x in xs[1:]:
            acc.add_(x)
        return acc.mul_(s).to(out_dtype)

    yield ("aggregate", "fp32", (k + 1) * n * 4, lambda: aggregate(fp32, s), {
        "add_ chain": lambda: add_chain(fp32, torch.float32),
        "stack.sum": lambda: torch.stack(fp32).sum(0).mul_(s),
    })
    yield ("aggregate", "bf16", (k + 1) * n * 2, lambda: aggregate(bf16, s), {
        "add_ chain": lambda: add_chain(bf16, torch.bfloat16),
        "stack.sum": lambda: torch.stack(bf16).sum(0, dtype=torch.float32).mul_(s).bfloat16(),
    })

    x, world = fp32[0], k
    for name, dtype in (("compress_fp16", torch.float16), ("compress_bf16", torch.bfloat16)):
        yield (name, "fp32", n * 6, lambda dtype=dtype: compress(x, dtype, 1.0 / world), {
            "DDP hook: div_ then cast": lambda dtype=dtype: torch.div(x, world).to(dtype),
        })
    half = x.half()
    out = torch.empty_like(x)
    yield ("decompress_fp16", "fp16", n * 6, lambda: decompress(half), {
        "DDP hook: copy_": lambda: out.copy_(half),
    })

    residual = torch.zeros_like(x)
    nb = -(-n // block)
    yield ("compress_int8", "fp32", n * 4 * 3 + n + nb * 4, lambda: compress_int8(x, residual, block), {
        "cast-divide-copy chain": lambda: reference.quantize_int8(x, residual, block),
    })
    c = compress_int8(x, block_size=block)
    payloads = c.payload.expand(k, n).contiguous()
    scales = c.scales.expand(k, nb).contiguous()
    yield ("dequantize_aggregate", "int8", k * (n + nb * 4) + n * 4,
           lambda: dequantize_aggregate(payloads, scales, block), {
               "cast-multiply-add chain": lambda: reference.dequantize_aggregate(payloads, scales, block, s,
                                                                                 torch.float32),
           })


def timed_copy_ms(nbytes: int, reps: int, device: str) -> float:
    """`timed_ms` of a copy that reads and writes `nbytes` in all (the yardstick of the ops' bandwidth); its
    buffers are freed on return."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return timed_ms(lambda: dst.copy_(src), reps, device)


def scale(args) -> tuple[str, int, int]:
    """(device, K, timed runs per measurement): tiny on CPU with --smoke."""
    return ("cpu", 3, 3) if args.smoke else ("cuda", args.workers, args.reps)


def about(args, k: int, reps: int) -> dict:
    """What a report says of its run: the device, the command, the versions, K, the repeats."""
    return {"device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(),
            "command": "python bench/cuda_ops.py " + " ".join(sys.argv[1:]),
            "torch": torch.__version__, "python": platform.python_version(),
            "workers": k, "reps": reps, "block_size": args.block_size}


def run(args) -> dict:
    device, k, reps = scale(args)
    n = 4099 if args.smoke else args.mb * 2**20 // 4
    rows = []
    for op, dtype, nbytes, ours, baselines in cases(n, k, args.block_size, device):
        copy_ms = timed_copy_ms(nbytes, reps, device)
        ms = timed_ms(ours, reps, device)
        for name, fn in baselines.items():
            base_ms = timed_ms(fn, reps, device)
            rows.append({
                "op": op, "dtype": dtype, "bytes": nbytes, "ms": ms,
                "GBps": nbytes / ms / 1e6, "copy_GBps": nbytes / copy_ms / 1e6,
                "pct_of_copy": 100 * copy_ms / ms,
                "baseline": name, "baseline_ms": base_ms, "speedup": base_ms / ms,
            })
        if device == "cuda":
            torch.cuda.empty_cache()
    return {**about(args, k, reps), "elements_per_input": n, "results": rows}


def sweep_cases(n: int, k: int, block: int, device: str):
    """(op, the op's public call, the same op's `reference` kernel, the Triton wrapper called directly; None
    on CPU, where Triton only interprets)."""
    T = importlib.import_module("gradsync.cuda_ops.triton_impl") if device == "cuda" else None
    g = torch.Generator(device=device).manual_seed(0)
    xs = [torch.randn(n, device=device, generator=g) for _ in range(k)]
    x, s, residual = xs[0], 1.0 / k, torch.zeros(n, device=device)
    c = compress_int8(x, block_size=block)
    payloads, scales = c.payload.expand(k, n).contiguous(), c.scales.expand(k, -1).contiguous()
    yield ("aggregate", lambda: aggregate(xs, s), lambda: reference.aggregate(xs, s, None),
           T and (lambda: T.aggregate(xs, s, None)))
    yield ("scaled_cast", lambda: compress(x, torch.float16, s), lambda: reference.scaled_cast(x, s, torch.float16),
           T and (lambda: T.scaled_cast(x, s, torch.float16)))
    yield ("quantize_int8", lambda: compress_int8(x, residual, block),
           lambda: reference.quantize_int8(x, residual, block), T and (lambda: T.quantize_int8(x, residual, block)))
    yield ("dequantize_aggregate", lambda: dequantize_aggregate(payloads, scales, block),
           lambda: reference.dequantize_aggregate(payloads, scales, block, s, torch.float32),
           T and (lambda: T.dequantize_aggregate(payloads, scales, block, s, torch.float32)))


def sweep(args) -> dict:
    """Per op and size: the op, its reference and its Triton wrapper (ms, median), and the crossover."""
    device, k, reps = scale(args)
    sizes = [4099] if args.smoke else [2**e for e in range(16, 27, 2)]
    rows = []
    for n in sizes:
        for op, ours, ref, direct in sweep_cases(n, k, args.block_size, device):
            rows.append({"op": op, "elements": n, "ms": timed_ms(ours, reps, device),
                         "reference_ms": timed_ms(ref, reps, device),
                         "triton_direct_ms": direct and timed_ms(direct, reps, device)})
        if device == "cuda":
            torch.cuda.empty_cache()
    crossover = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        slower = [r["elements"] for r in rows if r["op"] == op and r["ms"] > r["reference_ms"]]
        crossover[op] = max(slower) if slower else 0
    return {**about(args, k, reps), "sweep": rows, "reference_wins_up_to": crossover}


def sweep_table(report: dict) -> str:
    lines = [f"cuda_ops against reference on {report['device']}, K={report['workers']}, median of {report['reps']}",
             "", "| op | elements | op ms | Triton wrapper ms | reference ms | reference/op |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in report["sweep"]:
        direct = "-" if r["triton_direct_ms"] is None else f"{r['triton_direct_ms']:.3f}"
        lines.append(f"| {r['op']} | {r['elements']} | {r['ms']:.3f} | {direct} | "
                     f"{r['reference_ms']:.3f} | {r['reference_ms'] / r['ms']:.2f}x |")
    lines.append(f"\nreference wins up to (elements): {report['reference_wins_up_to']}")
    return "\n".join(lines)


def table(report: dict) -> str:
    lines = [
        f"cuda_ops on {report['device']}: {report['elements_per_input']} elements per input, "
        f"K={report['workers']}, median of {report['reps']}",
        "",
        "| op | dtype | ms | GB/s | % of copy | plain PyTorch | its ms | speedup |",
        "|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['op']} | {r['dtype']} | {r['ms']:.3f} | {r['GBps']:.1f} | {r['pct_of_copy']:.0f}% | "
            f"{r['baseline']} | {r['baseline_ms']:.3f} | {r['speedup']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.smoke:
        if not torch.cuda.is_available():
            sys.exit("bench/cuda_ops.py needs a CUDA GPU (torch.cuda.is_available() is False); run it on an "
                     "NVIDIA GPU machine, or pass --smoke to check the script on CPU")
        if importlib.util.find_spec("triton") is None:
            sys.exit("bench/cuda_ops.py needs Triton for the CUDA kernels: pip install 'triton>=3.0'")
    report = sweep(args) if args.sweep else run(args)
    slug = re.sub(r"[^a-z0-9]+", "-", report["device"].lower()).strip("-")
    out = args.out or RESULTS / f"cuda_ops-{slug}{'-sweep' if args.sweep else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(sweep_table(report) if args.sweep else table(report))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
