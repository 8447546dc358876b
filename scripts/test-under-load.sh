#!/usr/bin/env bash
# The test suite beside busy loops, as CI runs it (ctest -j 2 on 2 busy cores, issue #22):
# a test waits for a condition, never for a time, so every run here must pass.
#
#   scripts/test-under-load.sh [--runs N] [--burners K] [--ctest-only [-- CTEST_ARGS...]]
#
#   --runs N       run N times (default 3)
#   --burners K    CPU burners beside the runs (default 2)
#   --ctest-only   only the gcc CTest stage of scripts/test.sh, in build/ (built first if
#                  needed), for quick iteration; arguments after -- go to ctest as well,
#                  e.g. -- -R UpstreamStream --repeat until-fail:3
#
# Without --ctest-only each run is the whole scripts/test.sh (on a fresh machine its first
# run builds everything). Prints per run passed/failed, the failing tests and the wall time,
# then "N passed, M failed"; exits 0 only if every run passed. Each run's log stays in a
# directory under $TMPDIR, named at the start. The burners end with this script, however
# it ends: a trap kills them, and each one also stops once this script's pid is gone.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }

runs=3
burners=2
ctest_only=0
ctest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --runs) [ $# -ge 2 ] || { usage >&2; exit 2; }; runs=$2; shift 2 ;;
    --burners) [ $# -ge 2 ] || { usage >&2; exit 2; }; burners=$2; shift 2 ;;
    --ctest-only) ctest_only=1; shift ;;
    --) shift; ctest_args=("$@"); break ;;
    *) echo "test-under-load: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
for number in "$runs" "$burners"; do
  case "$number" in ''|*[!0-9]*) echo "test-under-load: $number is not a count" >&2; exit 2 ;; esac
done
if [ "${#ctest_args[@]}" -gt 0 ] && [ "$ctest_only" = 0 ]; then
  echo "test-under-load: arguments after -- need --ctest-only" >&2; exit 2
fi

burner_pids=()
stop_burners() {
  local pid
  for pid in "${burner_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${burner_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  burner_pids=()
}
trap stop_burners EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
start_burners() {
  local i
  # Each loop also checks that this script still lives: even a SIGKILL leaves none behind.
  for ((i = 0; i < burners; i++)); do
    sh -c 'while kill -0 "$1" 2>/dev/null; do :; done' burner $$ &
    burner_pids+=($!)
  done
}

# The same llama-servers scripts/test.sh uses, found (or built) before the load starts.
prepare_ctest_stage() {
  if [ -z "${LLAMA_SERVER:-}" ] && { [ "${KVSHARE_LLAMA_SERVER:-1}" != "0" ] || [ "${CI:-}" = "true" ]; }; then
    LLAMA_SERVER=$(scripts/build-llama-server.sh)
    export LLAMA_SERVER
  fi
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build build -j "$(nproc)"
  if [ -z "${LLAMA_SERVER_KVSHARE:-}" ] && [ -n "${LLAMA_SERVER:-}" ]; then
    LLAMA_SERVER_KVSHARE=$(KVSHARE_BUILD_DIR="$root/build" scripts/build-llama-server.sh --with-kvshare)
    export LLAMA_SERVER_KVSHARE
  fi
  echo "== llama-server: ${LLAMA_SERVER:-none}; patched: ${LLAMA_SERVER_KVSHARE:-none}"
}

run_once() {
  if [ "$ctest_only" = 1 ]; then
    (cd build && ctest --output-on-failure -j "$(nproc)" --timeout 900 "${ctest_args[@]}")
  else
    scripts/test.sh
  fi
}

# "name (Failed)" for every test a log's CTest summaries list, one line each.
failed_tests() {
  awk '/^The following tests FAILED:/ { listing = 1; next }
       listing && /^[[:space:]]+[0-9]+ - / { sub(/^[[:space:]]+[0-9]+ - /, ""); print; next }
       { listing = 0 }' "$1"
}

[ "$ctest_only" = 1 ] && prepare_ctest_stage
logs=$(mktemp -d "${TMPDIR:-/tmp}/kvshare-under-load.XXXXXX")
echo "== $runs run(s) of $([ "$ctest_only" = 1 ] && echo "the gcc CTest stage" || echo scripts/test.sh) beside $burners busy loop(s); logs in $logs"
passed=0
failed=0
for ((run = 1; run <= runs; run++)); do
  log="$logs/run-$run.log"
  start_burners
  started=$SECONDS
  status=0
  run_once >"$log" 2>&1 || status=$?
  elapsed=$((SECONDS - started))
  stop_burners
  if [ "$status" = 0 ]; then
    passed=$((passed + 1))
    echo "run $run/$runs: passed in ${elapsed} s"
    continue
  fi
  failed=$((failed + 1))
  stage=$(grep '^== ' "$log" | tail -n 1 || true)
  echo "run $run/$runs: FAILED in ${elapsed} s (exit $status, last stage: ${stage:-none}); log $log"
  names=$(failed_tests "$log")
  if [ -n "$names" ]; then
    sed 's/^/    /' <<<"$names"
  else
    echo "    no failing test named; the log ends:"
    tail -n 15 "$log" | sed 's/^/    | /'
  fi
done
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
