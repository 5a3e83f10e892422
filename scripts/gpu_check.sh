#!/usr/bin/env bash
# The GPU check, in one call on a lent GPU machine (no network; see ../shared/GPU.md):
# the wheels in .whl/ are installed into a folder outside the tree, then the device-path tests and
# `kvstore bench --device cuda` run; everything they print lands in $OUT.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
DEPS=/tmp/kvstore-deps
{ nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv; \
  python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"; nproc; } > "$OUT/machine.txt" 2>&1
python3 -m pip install --no-index --no-deps --quiet --target "$DEPS" .whl/*.whl > "$OUT/install.txt" 2>&1
export PYTHONPATH="$PWD:$DEPS"
TESTS=${GPU_TESTS:-tests/test_transfer.py tests/test_dram.py tests/test_store.py tests/test_prefetch.py}
timeout 150 python3 -m pytest -q -p no:cacheprovider $TESTS -k "not redis and not s3 and not remote" > "$OUT/tests.txt" 2>&1
echo "tests rc=$?" >> "$OUT/tests.txt"
tail -3 "$OUT/tests.txt"
timeout 330 python3 -c "from kvstore.cli import app; app()" bench --no-local --gpu --repeats 3 --dir /tmp \
  > "$OUT/bench.txt" 2>&1
echo "bench rc=$?" >> "$OUT/bench.txt"
cat "$OUT/machine.txt" "$OUT/bench.txt"
