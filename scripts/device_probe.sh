source scripts/device_env.sh
timeout 200 python3 scripts/probe_graph.py --math tf32 --batch 1 2>$OUT/probe_graph.err | tee $OUT/probe_graph.jsonl | cut -c1-1500
tail -3 $OUT/probe_graph.err; echo "graph probe at $SECONDS s"
timeout 150 python3 scripts/probe_fp32_plans.py 2>&1 > $OUT/fp32.jsonl; echo "fp32 probe at $SECONDS s"
NVIDIA_TF32_OVERRIDE=0 timeout 120 python3 scripts/probe_fp32_plans.py > $OUT/fp32_override0.jsonl 2>&1; echo "override probe at $SECONDS s"
grep -v '"error"' $OUT/fp32.jsonl $OUT/fp32_override0.jsonl | cut -c1-300 | head -150
