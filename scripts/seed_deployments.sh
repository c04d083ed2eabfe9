#!/bin/bash
# FastDeploy's seed deployments (docs/deployments.md), each command as the seed writes it: its --model id, its
# ports, every flag. The ids resolve offline (HF_HUB_OFFLINE=1) from a Hugging Face cache laid out as the hub writes
# it, holding the embedded tiny model in each id's layout: as is for the 21B Thinking id, the "-Paddle" layout for
# the 300B ids, pre-quantized W4A8 + C8 split into rank0/..rank3/ for the W4A8C8-TP4 id. Each server is asked one
# chat through its --port, or shows its refusal where this host cannot run it. A command is changed only where the
# tiny model or a CPU host forces it, in a second run printed with "+ changed: ... (why)". The ports are the seeds'
# own (8180-8187): run it where they are free. Logs in $LOGS (default out/seeds).
set -u
cd "$(dirname "$0")/.."
PY=.venv/bin/python
ES=.venv/bin/ernie-serve
LOGS=${LOGS:-out/seeds}
mkdir -p "$LOGS"
export HF_HOME=${SEED_HF_HOME:-$PWD/$LOGS/hf} HF_HUB_OFFLINE=1

# ---------------------------------------------------------------- the cache the seeds' ids resolve from
CK=$LOGS/checkpoints
TINY=$($PY -c "from ernie_serve.demo.tiny_model import ensure_tiny_model; print(ensure_tiny_model())" 2>/dev/null)
$PY -c "import sys; sys.path.insert(0, 'tests'); from hf_hub_cache import write_paddle_layout as w; w('$TINY', '$CK/paddle')" 2>/dev/null
if [ ! -d "$CK/w4a8c8-tp4" ]; then
  $PY scripts/quantize_checkpoint.py --model "$TINY" --out "$CK/w4a8c8" --quantization w4a8 --kv-cache-int8 >/dev/null 2>&1
  $PY scripts/shard_checkpoint.py --model "$CK/w4a8c8" --out "$CK/w4a8c8-tp4" --tensor-parallel-size 4 >/dev/null 2>&1
fi
$PY tests/hf_hub_cache.py "$HF_HOME" baidu/ERNIE-4.5-21B-A3B-Thinking="$TINY" \
  baidu/ERNIE-4.5-300B-A47B-Paddle="$CK/paddle" baidu/ERNIE-4.5-300B-A47B-W4A8C8-TP4-Paddle="$CK/w4a8c8-tp4" \
  2>/dev/null | sed 's/^/cache: /'

# ---------------------------------------------------------------- one deployment: start, chat, stop
chat() {  # $1 port
  curl -s -m 300 "http://127.0.0.1:$1/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"ernie","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":48,"temperature":0}' \
    | $PY -c 'import json,sys; r=json.load(sys.stdin); m=r["choices"][0]["message"]; print("   chat: reasoning", repr((m.get("reasoning_content") or "")[:50]), "| content", repr((m["content"] or "")[:60]))'
}
start() {  # name port flags...: 0 once /health answers on port; 1 (and the refusal printed) if the server exits
  local name=$1 port=$2; shift 2
  local shown="" a
  for a in "$@"; do case $a in *[\ \"{]*) shown+=" '$a'";; *) shown+=" $a";; esac; done
  echo "   \$ ${SEED_ENV:+$SEED_ENV }ernie-serve$shown"
  env $SEED_ENV $ES "$@" > "$LOGS/$name.log" 2>&1 &
  echo $! > "$LOGS/$name.pid"
  for _ in $(seq 1 600); do
    curl -s -m 2 "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
    kill -0 "$(cat "$LOGS/$name.pid")" 2>/dev/null || { echo "   refused: $(grep -v '^\[' "$LOGS/$name.log" | tail -1 | cut -c1-260)"; return 1; }
    sleep 1
  done
  echo "   did not come up in 600 s; log: $LOGS/$name.log"; return 1
}
stop() { kill -INT "$(cat "$LOGS/$1.pid")" 2>/dev/null; wait "$(cat "$LOGS/$1.pid")" 2>/dev/null; }
deploy() {  # name port flags...: start, chat through port, stop; 1 if refused
  start "$@" || return 1
  chat "$2"; stop "$1"
}

SEED_ENV=
M21=baidu/ERNIE-4.5-21B-A3B-Thinking
M300=baidu/ERNIE-4.5-300B-A47B-Paddle
T21="--tensor-parallel-size 1 --max-model-len 131072 --quantization wint8 --reasoning-parser ernie-x1 --tool-call-parser ernie-x1 --max-num-seqs 32"
HOST_GIB=$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo)

echo "== 21B-A3B-Thinking, one GPU"
deploy t21 8180 --model $M21 $T21 --port 8180

echo "== + prefix cache, a 50 GiB CPU tier, chunked prefill, the rejection sampler"
SEED_ENV=FD_SAMPLING_CLASS=rejection
deploy t21prefix 8180 --model $M21 $T21 --enable-prefix-caching --swap-space 50 --enable-chunked-prefill --port 8180 || {
  echo "   + changed: --swap-space 4 in place of 50 (this host has $HOST_GIB GiB of memory)"
  deploy t21prefix4 8180 --model $M21 $T21 --enable-prefix-caching --swap-space 4 --enable-chunked-prefill --port 8180; }
SEED_ENV=

echo "== 300B-A47B, WINT8 on 8 GPUs"
deploy tp8 8180 --model $M300 --tensor-parallel-size 8 --quantization wint8 --port 8180

echo "== 300B-A47B, WINT4 on 4 GPUs"
deploy tp4 8180 --model $M300 --tensor-parallel-size 4 --quantization wint4 --port 8180

echo "== 300B W4A8C8, pre-sharded for TP4"
deploy w4a8c8 8180 --model baidu/ERNIE-4.5-300B-A47B-W4A8C8-TP4-Paddle --tensor-parallel-size 4 --port 8180

echo "== 300B TP4 + prefix cache, a 50 GiB CPU tier, chunked prefill, MTP"
MTP='{"method": "mtp", "num_speculative_tokens": 1}'
deploy mtp 8180 --model $M300 --tensor-parallel-size 4 --enable-prefix-caching --swap-space 50 --enable-chunked-prefill \
  --speculative-config "$MTP" --port 8180 || {
  echo "   + changed: --swap-space 4 in place of 50 (this host has $HOST_GIB GiB of memory)"
  deploy mtp4 8180 --model $M300 --tensor-parallel-size 4 --enable-prefix-caching --swap-space 4 --enable-chunked-prefill \
    --speculative-config "$MTP" --port 8180; }

echo "== 1P1D on one host: prefill, then decode; the chat goes through the decode side's --port"
if start prefill 8180 --model $M300 --port 8180 --metrics-port 8181 --engine-worker-queue-port 8182 --cache-queue-port 8183 \
     --tensor-parallel-size 4 --quantization wint4 --splitwise-role "prefill"; then
  deploy decode 8184 --model $M300 --port 8184 --metrics-port 8185 --engine-worker-queue-port 8186 --cache-queue-port 8187 \
    --tensor-parallel-size 4 --quantization wint4 --innode-prefill-ports 8182 --splitwise-role "decode"
  stop prefill
fi
