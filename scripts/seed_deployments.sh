#!/bin/bash
# FastDeploy's seed deployments with their flags as written (README "Serving a real ERNIE-4.5 checkpoint on a GPU"),
# each served on the embedded tiny model and asked one chat, or refused at start-up naming the flag where this host
# cannot run it (CUDA graphs without a GPU, TP8 on a 4-head model, a 50 GiB CPU tier on a smaller host). The ports
# are the seeds' own (8180-8183, 8190-8191): run it on a host where they are free. Logs in $LOGS (default out/seeds).
set -u
cd "$(dirname "$0")/.."
ES=.venv/bin/ernie-serve
LOGS=${LOGS:-out/seeds}
mkdir -p "$LOGS"
chat() {  # $1 port
  curl -s -m 120 http://127.0.0.1:$1/v1/chat/completions -H 'content-type: application/json' \
    -d '{"model":"ernie","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":48,"temperature":0}' \
    | python3 -c 'import json,sys; r=json.load(sys.stdin); m=r["choices"][0]["message"]; print("  reasoning:", repr((m.get("reasoning_content") or "")[:60]), "| content:", repr(m["content"][:60]))'
}
wait_up() {  # $1 port
  for i in $(seq 1 240); do curl -s -m 2 http://127.0.0.1:$1/health >/dev/null 2>&1 && return 0; sleep 1; done; return 1
}
refused() { echo "== $1"; shift; timeout 120 $ES "$@" 2>&1 | tail -1 | cut -c1-300; }
serve() {  # name port flags...
  name=$1; port=$2; shift 2
  echo "== $name"
  $ES "$@" > "$LOGS/$name.log" 2>&1 &
  echo $! > "$LOGS/$name.pid"
  wait_up $port || { echo "  did not come up"; tail -5 "$LOGS/$name.log"; }
}
stop() { kill -INT $(cat "$LOGS/$1.pid") 2>/dev/null; wait $(cat "$LOGS/$1.pid") 2>/dev/null; }

BASIC="--load-choices default_v1 --tensor-parallel-size 1 --max-model-len 131072 --quantization wint8 --reasoning-parser ernie-x1 --tool-call-parser ernie-x1 --max-num-seqs 32"
serve basic 8180 --port 8180 --metrics-port 8181 $BASIC; chat 8180; stop basic
refused "basic + --use-cudagraph (CPU)" --port 8180 $BASIC --use-cudagraph
refused "300B TP8 on the 4-head tiny model" --port 8180 --tensor-parallel-size 8 --quantization wint8
FD_SAMPLING_CLASS=rejection refused "21B + prefix cache, --swap-space 50, chunked (23 GiB host)" --port 8180 $BASIC --enable-prefix-caching --swap-space 50 --enable-chunked-prefill
# the seed's TP4 + MTP deployment, with a 4 GiB CPU tier in place of its 50 (refused above on a small host)
FD_SAMPLING_CLASS=rejection serve tp4mtp 8180 --port 8180 --metrics-port 8181 --tensor-parallel-size 4 --max-model-len 4096 --enable-prefix-caching --swap-space 4 --enable-chunked-prefill --reasoning-parser ernie-x1 --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'
chat 8180; stop tp4mtp
serve prefill 8180 --port 8180 --metrics-port 8181 --engine-worker-queue-port 8182 --cache-queue-port 8183 --tensor-parallel-size 4 --quantization wint4 --splitwise-role prefill --reasoning-parser ernie-x1
serve decode 8190 --port 8190 --metrics-port 8191 --tensor-parallel-size 4 --quantization wint4 --splitwise-role decode --innode-prefill-ports 8182 --reasoning-parser ernie-x1
chat 8190; stop decode; stop prefill
