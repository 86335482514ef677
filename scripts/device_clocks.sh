#!/bin/bash
# One short H200 run on whether the GPU slows down under sustained load (a batch computes
# in ~4.57 ms under `client load` against ~4.38 ms in the bench's short timed replays):
# nvidia-smi samples clocks, power, temperature and throttle reasons every 200 ms while an
# FP16 GEMM runs back to back for SECONDS (25); the GEMM's time per second of the run is
# printed as JSON lines. Samples land in $OUT/clocks.csv.
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 200 > $OUT/clocks.csv 2>&1 &
SMI=$!
python3 - ${SECONDS_LOAD:-25} <<'PY' | tee $OUT/gemm.jsonl
import json, sys, time
import cupy as cp
n = 8192
a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
b = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
start, end = cp.cuda.Event(), cp.cuda.Event()
t0, per_second = time.monotonic(), {}
while (second := time.monotonic() - t0) < float(sys.argv[1]):
    start.record()
    for _ in range(20):
        c = a @ b
    end.record()
    end.synchronize()
    per_second.setdefault(int(second), []).append(cp.cuda.get_elapsed_time(start, end) / 20)
for second, times in sorted(per_second.items()):
    ms = sum(times) / len(times)
    print(json.dumps({"second": second, "gemm_ms": round(ms, 4), "tflops": round(2 * n**3 / ms / 1e9, 1)}))
PY
kill $SMI
awk -F', ' 'NR>1 {print $2, $4, $5, $6}' $OUT/clocks.csv | sort | uniq -c | sort -rn | head -8
