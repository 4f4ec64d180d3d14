#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one run (CI has none): the CUDA twins of the cuda_ops tests and the
# Triton kernels compiled for the device, a CUDA server shard against the CPU one, parity with the servers'
# shards on the GPU, then bench/cuda_ops.py at K = 2, 8 and 16 with 256 MB inputs and at K = 8 with 4, 16 and
# 64 MB inputs (bench/results/cuda_ops-<gpu>-k<K>-<MB>mb.json) and the sweep of each op against its reference
# at K = 2 and 8 (where `cuda_ops.ops.SMALL` comes from: ...-sweep-k<K>.json), then the whole suite (-v: the
# failures stay in the log if its time runs out).
#
#     bash bench/gpu.sh [LOGS]     # LOGS: where the test logs go (default /tmp/gradsync-gpu)
#
# Uses the python3 on the PATH (the machine's own torch with CUDA, not .venv's CPU wheel); put grpcio and
# protobuf of requirements.txt's versions first on PYTHONPATH where that python has older ones (the generated
# code needs protobuf 7). On a torch other than the pinned one, the suite's pin checks fail (test_torch_internals,
# test_proto_codec's regenerated code): expected there.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${1:-/tmp/gradsync-gpu}
mkdir -p "$logs"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, grpc, google.protobuf as pb
print('torch', torch.__version__, 'triton', triton.__version__, 'grpcio', grpc.__version__, 'protobuf', pb.__version__)
assert torch.cuda.is_available(), 'no CUDA device'
print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())" 2>&1 | tee "$logs/versions.txt"
gpu=$(python3 -c "import re, torch; print(re.sub('[^a-z0-9]+', '-', torch.cuda.get_device_name().lower()).strip('-'))")

echo "== CUDA tests"
timeout 300 python3 -m pytest -q -p timeout -rs tests/cuda_ops/test_cuda_ops.py \
    tests/cuda_ops/test_cuda_ops_kernels.py tests/cuda_ops/test_cuda_ops_compile.py tests/ps/test_consistency.py \
    tests/ps/test_compression.py 2>&1 | tee "$logs/cuda_tests.log"

echo "== parity with the servers' shards on the GPU"
GRADSYNC_SERVER_DEVICE=cuda timeout 240 python3 -m pytest -q -p timeout -n 4 tests/worker/test_parity.py \
    2>&1 | tee "$logs/server_on_gpu.log"

echo "== bench/cuda_ops.py"
for run in "2 256" "8 256" "16 256" "8 4" "8 16" "8 64"; do
    set -- $run
    timeout 120 python3 bench/cuda_ops.py --workers "$1" --mb "$2" --out "bench/results/cuda_ops-$gpu-k$1-$2mb.json"
done

for k in 2 8; do
    timeout 120 python3 bench/cuda_ops.py --sweep --workers "$k" --out "bench/results/cuda_ops-$gpu-sweep-k$k.json"
done

echo "== the whole suite"
timeout 400 python3 -m pytest -v -p timeout -n 8 --timeout 120 tests > "$logs/suite.log" 2>&1
grep -E " (FAILED|ERROR) " "$logs/suite.log" | sed 's/.*\(FAILED\|ERROR\) //' | sort
grep -E "passed|failed" "$logs/suite.log" | tail -1
