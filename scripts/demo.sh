#!/usr/bin/env bash
# The main job: the hybrid route end to end on any machine.
#   1. builds kvshare (cmake + ninja into build/) unless the tools are there already, and the
#      decoder of record: llama-server with the patch series of integrations/llama.cpp
#      (scripts/build-llama-server.sh --with-kvshare; 10-30 minutes on 2 cores the first
#      time, cached in ~/.cache/kvshare afterwards; LLAMA_SERVER_KVSHARE=path uses one built
#      already), with llama-kvshare-prefill, its reference provider;
#   2. generates a tiny random-weight model with kvshare-mkmodel;
#   3. starts kvshare-serve --device hybrid with ONEBIT_KV_SHARE=1 (the shared route: the
#      decoder's KV cache handed over as fds, no state file) on a free loopback port, and
#      beside it kvshare-serve --device cpu (the same decoder alone);
#   4. sends a two-turn chat to both (turn 2 hands over only what the decoder's cells do not
#      hold), prints each reply beside the decoder's own, and serve's `hybrid:` lines;
#      exits 1 if a reply differs;
#   5. stops both cleanly (SIGTERM) and removes what it made.
# KVSHARE_BUILD_DIR=dir uses another build directory; KVSHARE_DEMO_ROUTE=file shows the
# state-file route instead. KVSHARE_DEMO_DECODER=reference runs the reference pair
# (kvshare-prefill, kvshare-decoder) instead of llama-server: no llama.cpp build.
# KVSHARE_DEMO_DEVICE=vulkan runs llama-server as a GPU decoder: every layer and its KV cache
# on a Vulkan device (-ngl 99; GGML_VK_VISIBLE_DEVICES, default 0: on a machine without a
# GPU that is lavapipe, Mesa's Vulkan device on the CPU), the region imported by the device;
# with no Vulkan device the demo says so and stays on the CPU.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KVSHARE_BUILD_DIR:-$root/build}
bin=$build/bin
route=${KVSHARE_DEMO_ROUTE:-shared}
decoder_kind=${KVSHARE_DEMO_DECODER:-llama-server}
case "$decoder_kind" in reference|llama-server) ;; *) echo "KVSHARE_DEMO_DECODER=$decoder_kind: not llama-server or reference"; exit 2 ;; esac
device=${KVSHARE_DEMO_DEVICE:-cpu}
case "$device" in cpu|vulkan) ;; *) echo "KVSHARE_DEMO_DEVICE=$device: not cpu or vulkan"; exit 2 ;; esac

need=(kvshare-serve kvshare-decoder kvshare-prefill kvshare-mkmodel)
missing=0
for tool in "${need[@]}"; do [ -x "$bin/$tool" ] || missing=1; done
if [ "$missing" = 1 ]; then
  echo "== building kvshare into $build"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$build" --target "${need[@]}" -j "$(nproc)"
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/kvshare-demo-XXXXXX")
serve_pid=
cpu_pid=
cleanup() {
  for pid in $serve_pid $cpu_pid; do
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
      wait "$pid" 2>/dev/null || true
    fi
  done
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

backend=$bin/kvshare-decoder
provider=$bin/kvshare-prefill
if [ "$decoder_kind" = llama-server ]; then
  if [ -n "${LLAMA_SERVER_KVSHARE:-}" ] && [ -x "$LLAMA_SERVER_KVSHARE" ]; then
    echo "== the patched llama-server (LLAMA_SERVER_KVSHARE)"
    backend=$LLAMA_SERVER_KVSHARE
  else
    echo "== the patched llama-server (scripts/build-llama-server.sh --with-kvshare; 10-30 minutes the first time)"
    backend=$(KVSHARE_BUILD_DIR="$build" "$root/scripts/build-llama-server.sh" --with-kvshare)
  fi
  provider=$(dirname "$backend")/llama-kvshare-prefill
  [ -x "$provider" ] || { echo "no llama-kvshare-prefill beside $backend"; exit 1; }
  echo "   $backend"
fi
decoder_args=()
if [ "$device" = vulkan ]; then
  if [ "$decoder_kind" != llama-server ]; then
    echo "== KVSHARE_DEMO_DEVICE=vulkan: the reference decoder has no GPU backend; staying on the CPU"
  else
    export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0}
    vk=$("$backend" --list-devices 2>&1 | grep -m1 -o 'Vulkan[0-9]*: .*' || true)
    if [ -z "$vk" ]; then
      echo "== KVSHARE_DEMO_DEVICE=vulkan: llama-server lists no Vulkan device (GGML_VK_VISIBLE_DEVICES=$GGML_VK_VISIBLE_DEVICES); staying on the CPU"
      unset GGML_VK_VISIBLE_DEVICES
    else
      echo "== the decoder on $vk (-ngl 99; lavapipe is Vulkan on the CPU)"
      # -lv 4: libllama's line saying where the cache is goes to serve's log
      decoder_args=(-- -ngl 99 -lv 4)
    fi
  fi
fi

echo "== a tiny model (kvshare-mkmodel, random weights, byte-level BPE, ChatML template)"
# --residual-gain 3: the reply depends on the whole prompt, not only its last token.
"$bin/kvshare-mkmodel" "$work/tiny.gguf" --seed 42 --residual-gain 3 >/dev/null
ls -l "$work/tiny.gguf" | awk '{print "   " $NF ": " $5 " bytes"}'

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_listening() {  # PID LOG
  for _ in $(seq 1 300); do
    grep -q "kvshare-serve: listening on" "$2" && return 0
    kill -0 "$1" 2>/dev/null || { cat "$2"; echo "kvshare-serve exited"; exit 1; }
    sleep 0.1
  done
  cat "$2"; echo "kvshare-serve is not listening"; exit 1
}
port=$(free_port)
cpu_port=$(free_port)
echo "== kvshare-serve --device hybrid on 127.0.0.1:$port (route: $route); --device cpu, the decoder alone, on 127.0.0.1:$cpu_port"
if [ "$route" = shared ]; then export ONEBIT_KV_SHARE=1; else unset ONEBIT_KV_SHARE; fi
# --handoff always: the demo shows the handoff itself. By default (auto) serve forwards what
# the decoder alone would answer sooner (docs/hybrid.md, "When serve hands off").
"$bin/kvshare-serve" -m "$work/tiny.gguf" --device hybrid --prefill-provider "$provider" --handoff always \
  --backend "$backend" --host 127.0.0.1 --port "$port" -c 1024 -fa on "${decoder_args[@]}" \
  2>"$work/serve.log" &
serve_pid=$!
unset ONEBIT_KV_SHARE
"$bin/kvshare-serve" -m "$work/tiny.gguf" --device cpu --backend "$backend" --host 127.0.0.1 --port "$cpu_port" \
  -c 1024 -fa on "${decoder_args[@]}" 2>"$work/cpu.log" &
cpu_pid=$!
wait_listening "$serve_pid" "$work/serve.log"
wait_listening "$cpu_pid" "$work/cpu.log"

echo "== a two-turn chat (POST /v1/chat/completions), to both"
python3 - "$port" "$cpu_port" <<'PYTHON_END'
import http.client, json, sys

def ask(port, messages):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"messages": messages, "max_tokens": 16, "temperature": 0}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    reply = json.loads(conn.getresponse().read())
    return reply["choices"][0]["message"]["content"], reply["timings"]

hybrid_port, cpu_port = int(sys.argv[1]), int(sys.argv[2])
messages = [{"role": "system", "content": "You are a tiny random model."},
            {"role": "user", "content": "Say something about the hybrid route."}]
same = True
for turn, follow_up in ((1, "And now something about the decoder, please."), (2, None)):
    hybrid, timings = ask(hybrid_port, messages)
    alone, _ = ask(cpu_port, messages)
    same = same and hybrid == alone
    print("turn %d  hybrid:        %r" % (turn, hybrid))
    print("        decoder alone: %r (%s)" % (alone, "the same" if hybrid == alone else "DIFFERENT"))
    print("        timings: prompt_n %d (after the handoff the decoder evaluated only the last token)" %
          timings["prompt_n"])
    if follow_up:
        messages += [{"role": "assistant", "content": alone}, {"role": "user", "content": follow_up}]
sys.exit(0 if same else 1)
PYTHON_END
sleep 0.2
if [ "$route" = shared ]; then
  echo "== serve's hybrid: lines (turn 2: what the decoder's cells hold is cached, the rest prefilled)"
else
  echo "== serve's hybrid: lines (the file route hands over whole prompts)"
fi
grep "^hybrid:" "$work/serve.log" | sed 's/^/   /'
if [ "${#decoder_args[@]}" -gt 0 ]; then
  echo "== where the decoder's KV cache is (its log)"
  grep -o "kvshare: KV cache on device.*\|kvshare: KV cache in exported region.*" "$work/serve.log" | sed 's/^/   /'
fi

echo "== stopping both serves (SIGTERM)"
status=0
for pid in $serve_pid $cpu_pid; do
  kill -TERM "$pid"
  wait "$pid" || status=$?
done
serve_pid=
cpu_pid=
echo "   exit status $status"
[ "$status" = 0 ]
grep -q "^hybrid: .* prompt tokens" "$work/serve.log"
echo "== done"
