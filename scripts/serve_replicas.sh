#!/usr/bin/env bash
# N replicas of the server (each a tritonserver + OpenAI shim, as scripts/serve.sh starts them, on ports of its own)
# behind sglang-router on one host; clients talk to the router's port as they would to one server's --openai-port.
#   scripts/serve_replicas.sh                                   # 2 replicas of the tiny model, router on :9000
#   scripts/serve_replicas.sh --replicas 4 --policy cache_aware --port 9000 --base-port 8100 \
#       -- --model /ckpt --max-model-len 8192 --reasoning-parser ernie-x1 --tool-call-parser ernie-x1
# Replica i listens on base-port + 10*i (HTTP), +1 (gRPC), +2 (metrics), +3 (OpenAI shim); with --base-port 0 each
# replica's ports are chosen when it starts (printed in its log). Flags after `--` go to
# every replica's serve.sh; --router-args "..." go to the router. Ctrl-C / SIGTERM stops the router, then drains and
# stops the replicas. On many hosts, start scripts/serve.sh --host 0.0.0.0 --openai-port 9000 on each and point one
# router at their URLs (docs/scaling-out.md).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
replicas=2 port=9000 base=8100 policy=cache_aware host=127.0.0.1 router_args=""
while [ $# -gt 0 ]; do
  case "$1" in
    --replicas) replicas="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --base-port) base="$2"; shift 2 ;;
    --policy) policy="$2"; shift 2 ;;
    --host) host="$2"; shift 2 ;;
    --router-args) router_args="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "serve_replicas.sh: unknown flag $1 (replica flags go after --)" >&2; exit 2 ;;
  esac
done
if ! [[ "$replicas" =~ ^[1-9][0-9]*$ ]]; then
  echo "serve_replicas.sh: --replicas must be a positive integer, got $replicas" >&2; exit 2
fi
py="$root/.venv/bin/python"
if [ ! -x "$py" ] || ! "$py" -c "import ernie_serve, sglang_router" 2>/dev/null; then
  "$root/scripts/setup.sh"
fi

logs="$(mktemp -d "${TMPDIR:-/tmp}/ernie-replicas-XXXXXX")"
pids=() urls=()
stop() {
  trap - INT TERM EXIT
  [ -n "${router_pid:-}" ] && kill -TERM "$router_pid" 2>/dev/null || true
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done  # each drains, then stops
  wait 2>/dev/null || true
}
trap stop EXIT
trap 'stop; exit 0' INT TERM

for ((i = 0; i < replicas; i++)); do
  if [ "$base" = 0 ]; then
    ports=(0 0 0 0)  # each replica on ports of its own, read from its ready banner below
  else
    p=$((base + 10 * i)); ports=("$p" $((p + 1)) $((p + 2)) $((p + 3)))
  fi
  "$root/scripts/serve.sh" --host "$host" --http-port "${ports[0]}" --grpc-port "${ports[1]}" \
    --metrics-port "${ports[2]}" --openai-port "${ports[3]}" "$@" > "$logs/replica$i.log" 2>&1 &
  pids+=("$!")
done
echo "[serve_replicas] starting $replicas replicas (logs in $logs) ..."
for ((i = 0; i < replicas; i++)); do
  # the replica's OpenAI URL once its /health answers (its port from its banner when it was given 0)
  if ! url="$("$py" - "$logs/replica$i.log" "${pids[$i]}" "$host" <<'EOF'
import sys, time, urllib.request
from ernie_serve.cli.serve import banner_ports
log, pid, host = sys.argv[1], int(sys.argv[2]), sys.argv[3]
deadline = time.monotonic() + 900
while time.monotonic() < deadline:
    try:  # a child of this script that exited is a zombie until the script waits for it: alive to os.kill(pid, 0)
        if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
            sys.exit(1)
    except OSError:
        sys.exit(1)
    port = banner_ports(open(log, errors="replace").read()).get("openai")
    try:
        if port:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2) as r:
                if r.status == 200:
                    print(f"http://{host}:{port}")
                    sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
sys.exit(1)
EOF
)"; then
    echo "[serve_replicas] replica $i did not come up; its log ($logs/replica$i.log):" >&2
    tail -n 30 "$logs/replica$i.log" >&2
    exit 1
  fi
  urls+=("$url")
done

# A replica that drains or dies leaves the rotation after two failed health checks two seconds apart.
# shellcheck disable=SC2086  # router_args is a list of flags
"$py" -m sglang_router.launch_router --host "$host" --port "$port" --worker-urls "${urls[@]}" --policy "$policy" \
  --health-check-interval-secs 2 --health-failure-threshold 2 --worker-startup-check-interval 1 \
  --prometheus-host "$host" --prometheus-port $((port + 1)) $router_args > "$logs/router.log" 2>&1 &
router_pid=$!
if ! "$py" - "http://$host:$port" "$replicas" "$router_pid" <<'EOF'
import json, sys, time, urllib.request
url, n, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    try:  # a child of this script that exited is a zombie until the script waits for it: alive to os.kill(pid, 0)
        if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
            sys.exit(1)
    except OSError:
        sys.exit(1)
    try:
        with urllib.request.urlopen(url + "/readiness", timeout=2) as r:
            if json.loads(r.read()).get("healthy_workers") == n:
                sys.exit(0)
    except (OSError, ValueError):
        pass
    time.sleep(0.5)
sys.exit(1)
EOF
then
  echo "[serve_replicas] the router did not see $replicas healthy replicas; its log ($logs/router.log):" >&2
  tail -n 30 "$logs/router.log" >&2
  exit 1
fi
echo "[serve_replicas] ready: $replicas replicas behind sglang-router ($policy)
  OpenAI   http://$host:$port/v1   (the router)
  replicas ${urls[*]}
  metrics  http://$host:$((port + 1))/metrics (router), each replica's /metrics and its Triton metrics port
  logs     $logs
  Ctrl-C to stop."
# Until the router or any replica exits (or a signal stops all of them).
wait -n "$router_pid" "${pids[@]}" || true
echo "[serve_replicas] a process exited; stopping the rest" >&2
exit 1
