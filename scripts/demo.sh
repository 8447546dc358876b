#!/usr/bin/env bash
# The main job: the hybrid route end to end on any machine, in about a minute.
#   1. builds kvshare (cmake + ninja into build/) unless the tools are there already;
#   2. generates a tiny random-weight model with kvshare-mkmodel;
#   3. starts kvshare-serve --device hybrid with the reference pair (kvshare-prefill
#      prefills, kvshare-decoder decodes) and ONEBIT_KV_SHARE=1 (the shared route: the
#      decoder's KV cache handed over as fds, no state file) on a free loopback port;
#   4. sends a chat request, prints the reply and serve's `hybrid:` lines;
#   5. stops serve cleanly (SIGTERM) and removes what it made.
# KVSHARE_BUILD_DIR=dir uses another build directory; KVSHARE_DEMO_ROUTE=file shows the
# state-file route instead. KVSHARE_DEMO_DECODER=llama-server runs the same demo with the
# real decoder: llama-server and llama-kvshare-prefill built with the patch series of
# integrations/llama.cpp (scripts/build-llama-server.sh --with-kvshare, on first use).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KVSHARE_BUILD_DIR:-$root/build}
bin=$build/bin
route=${KVSHARE_DEMO_ROUTE:-shared}
decoder_kind=${KVSHARE_DEMO_DECODER:-reference}
case "$decoder_kind" in reference|llama-server) ;; *) echo "KVSHARE_DEMO_DECODER=$decoder_kind: not reference or llama-server"; exit 2 ;; esac

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
cleanup() {
  if [ -n "$serve_pid" ] && kill -0 "$serve_pid" 2>/dev/null; then
    kill -TERM "$serve_pid" 2>/dev/null || true
    wait "$serve_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

backend=$bin/kvshare-decoder
provider=$bin/kvshare-prefill
if [ "$decoder_kind" = llama-server ]; then
  echo "== the patched llama-server (scripts/build-llama-server.sh --with-kvshare; long the first time)"
  backend=$(KVSHARE_BUILD_DIR="$build" "$root/scripts/build-llama-server.sh" --with-kvshare)
  provider=$(dirname "$backend")/llama-kvshare-prefill
  echo "   $backend"
fi

echo "== a tiny model (kvshare-mkmodel, random weights, byte-level BPE, ChatML template)"
"$bin/kvshare-mkmodel" "$work/tiny.gguf" --seed 42 >/dev/null
ls -l "$work/tiny.gguf" | awk '{print "   " $NF ": " $5 " bytes"}'

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
echo "== kvshare-serve --device hybrid on 127.0.0.1:$port (route: $route)"
if [ "$route" = shared ]; then export ONEBIT_KV_SHARE=1; else unset ONEBIT_KV_SHARE; fi
"$bin/kvshare-serve" -m "$work/tiny.gguf" --device hybrid --prefill-provider "$provider" --handoff always \
  --backend "$backend" --host 127.0.0.1 --port "$port" -c 1024 -fa on \
  2>"$work/serve.log" &
serve_pid=$!
for _ in $(seq 1 300); do
  grep -q "kvshare-serve: listening on" "$work/serve.log" && break
  kill -0 "$serve_pid" 2>/dev/null || { cat "$work/serve.log"; echo "kvshare-serve exited"; exit 1; }
  sleep 0.1
done
grep -q "kvshare-serve: listening on" "$work/serve.log" || { cat "$work/serve.log"; echo "not listening"; exit 1; }

request='{"messages": [{"role": "system", "content": "You are a tiny random model."},
                       {"role": "user", "content": "Say something about the hybrid route."}],
          "max_tokens": 16, "temperature": 0}'
echo "== POST /v1/chat/completions"
reply=$(python3 - "$port" "$request" <<'EOF'
import http.client, json, sys
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=120)
conn.request("POST", "/v1/chat/completions", body=sys.argv[2], headers={"Content-Type": "application/json"})
body = json.loads(conn.getresponse().read())
print("reply:    %r" % body["choices"][0]["message"]["content"])
print("timings:  prompt_n %d (the decoder evaluated only the prompt's last token), cache_n %d" %
      (body["timings"]["prompt_n"], body["timings"].get("cache_n", -1)))
EOF
)
echo "$reply"
sleep 0.2
echo "== serve's hybrid: lines"
grep "^hybrid:" "$work/serve.log" | sed 's/^/   /'

echo "== stopping kvshare-serve (SIGTERM)"
kill -TERM "$serve_pid"
wait "$serve_pid" && status=0 || status=$?
serve_pid=
echo "   exit status $status"
[ "$status" = 0 ]
grep -q "^hybrid: .* prompt tokens: " "$work/serve.log"
echo "== done"
