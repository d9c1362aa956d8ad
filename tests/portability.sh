#!/usr/bin/env bash
# The whole suite once per ATEN_CPU_CAPABILITY this CPU supports (default; avx2 and avx512 where /proc/cpuinfo has
# avx2 / avx512f), a line each: ATen's kernels, and so fused AdamW's vector body and scalar tail, differ between them,
# so a test that asserts bit-equality across two layouts or kernel paths fails under one of them (docs/testing.md).
#   bash tests/portability.sh [pytest args]     logs in runs/portability/<capability>.log; exit 1 if any run failed
set -uo pipefail
cd "$(dirname "$0")/.."
caps=(default)
grep -qw avx2 /proc/cpuinfo && caps+=(avx2)
grep -qw avx512f /proc/cpuinfo && caps+=(avx512)
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'); capabilities: ${caps[*]}"
mkdir -p runs/portability
status=0
for cap in "${caps[@]}"; do
    log="runs/portability/$cap.log"
    start=$(date +%s)
    ATEN_CPU_CAPABILITY="$cap" bash tests/run.sh "$@" >"$log" 2>&1
    rc=$?
    summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$log" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')
    passed=$(grep -oE '[0-9]+ passed' <<<"$summary" | grep -oE '[0-9]+' || echo 0)
    failed=$(( $(grep -oE '[0-9]+ failed' <<<"$summary" | grep -oE '[0-9]+' || echo 0) + \
               $(grep -oE '[0-9]+ errors?' <<<"$summary" | grep -oE '[0-9]+' || echo 0) ))
    echo "ATEN_CPU_CAPABILITY=$cap: $passed passed, $failed failed (exit $rc, $(( $(date +%s) - start )) s; $summary; $log)"
    [ "$rc" -eq 0 ] || status=1
done
exit $status
