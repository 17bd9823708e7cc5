#!/usr/bin/env bash
# Soak: start `tierserve serve` (or use $URL), ramp Locust users to find the saturation
# point (where throughput stops rising, p99 TTFT crosses the SLO or requests fail), then hold
# that load for $HOLD seconds and check: no failed request, each tier's resident memory grew
# less than 10%, no tier restarted, and every KV block is free again afterwards.
#
#   OMP_NUM_THREADS=1 loadtests/soak.sh            # HOLD=600 RAMP=4,8,16,32,64,128 STAGE=60
set -euo pipefail
OUT=${OUT:-soak-report}
HOLD=${HOLD:-600}
RAMP=${RAMP:-4,8,16,32,64,128}
STAGE=${STAGE:-60}
SLO_TTFT_MS=${SLO_TTFT_MS:-10000}
mkdir -p "$OUT"
if [ -z "${URL:-}" ]; then
    PORT=$(python -c "from serving.gateway.upstream import free_port; print(free_port())")
    URL="http://127.0.0.1:$PORT"
    tierserve serve --port "$PORT" ${CONFIG:+--config "$CONFIG"} >"$OUT/serve.log" 2>&1 &
    SERVER=$!
    trap 'kill -TERM $SERVER; wait $SERVER || true' EXIT
    until curl -sf "$URL/health" | grep -q '"status":"ok"'; do
        kill -0 $SERVER || { echo "tierserve serve died; see $OUT/serve.log" >&2; exit 1; }
        sleep 1
    done
fi
tierserve loadtest --url "$URL" --ramp "$RAMP" --duration "$STAGE" --spawn-rate 4 \
    --slo-ttft-p99-ms "$SLO_TTFT_MS" --out "$OUT/ramp" || true  # the ramp may pass the SLO
USERS=$(python -c "import json; print(json.load(open('$OUT/ramp/summary.json'))['users'])")
echo "soak: holding $USERS users for $HOLD s"
tierserve loadtest --url "$URL" --users "$USERS" --spawn-rate 4 --duration "$HOLD" \
    --slo-ttft-p99-ms "$SLO_TTFT_MS" --slo-error-rate 0 --max-rss-growth 0.10 --check-kv-empty \
    --out "$OUT/hold"
