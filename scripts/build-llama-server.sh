#!/usr/bin/env bash
# Builds the real llama-server kvshare is tested against, from the npm registry, into a cache
# outside the tree, and prints the binary's path as its only line on stdout.
#
#   scripts/build-llama-server.sh              stock llama-server (the pin in llama-cpp.pin)
#   scripts/build-llama-server.sh --with-kvshare   the same tree with integrations/llama.cpp applied,
#                                                  the Vulkan backend beside the CPU one, and
#                                                  llama-kvshare-prefill beside llama-server
#   scripts/build-llama-server.sh --repin V    rewrite llama-cpp.pin for node-llama-cpp@V
#
# Where llama.cpp comes from: the npm package node-llama-cpp ships a whole llama.cpp tree as
# a git bundle (package/llama/gitRelease.bundle). `npm pack` fetches the pinned version, the
# tarball's sha512 must equal the pinned integrity and the bundle's commit the pinned commit;
# nothing else is downloaded. No llama.cpp source or binary is ever put in this repository.
#
# The cache: ${KVSHARE_CACHE:-$HOME/.cache/kvshare}/llama.cpp/<commit>/stock/{src,build-<key>}
# where <key> hashes the CMake flags below and this script's build recipe; a second run with
# the build present takes a few seconds (ninja finds nothing to do). --with-kvshare adds
# kvshare/{prefix,src,build-<key>,build-<key>-prefix,prefill-<pkey>}: kvshare installed, the
# patched tree and its build, that build's libllama installed, and llama-kvshare-prefill
# (integrations/llama.cpp/kvshare-prefill, built out of the llama.cpp tree against both
# prefixes; <pkey> hashes <key> and the provider's sources). Compiles go through
# ccache (one cache for every tree, base dir = the tree's parent, so two trees that differ in
# a few files share every other object). Progress goes to stderr; a failed build prints the
# end of its log and exits 1.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
pin_file="$root/scripts/llama-cpp.pin"
cache=${KVSHARE_CACHE:-$HOME/.cache/kvshare}

say() { echo "build-llama-server: $*" >&2; }
die() { say "$*"; exit 1; }

usage() {
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  echo "Environment: KVSHARE_CACHE (cache root, default \$HOME/.cache/kvshare), KVSHARE_JOBS (parallel compiles, default nproc)."
  echo "--with-kvshare: KVSHARE_BUILD_DIR (the kvshare build to install, default build/ of this tree),"
  echo "  KVSHARE_LLAMA_VULKAN (1, the default: build the Vulkan backend too; 0: the CPU backend alone)."
}

repin() {
  local version=$1 scratch integrity commit
  scratch=$(mktemp -d)
  trap 'rm -rf "$scratch"' RETURN
  (cd "$scratch" && npm pack --silent "node-llama-cpp@$version" >/dev/null) || die "npm pack node-llama-cpp@$version failed"
  integrity=$(npm view "node-llama-cpp@$version" dist.integrity) || die "npm view node-llama-cpp@$version failed"
  [ "$(sri_of "$scratch"/node-llama-cpp-"$version".tgz)" = "$integrity" ] || die "the tarball does not match the registry's integrity $integrity"
  tar -xzf "$scratch"/node-llama-cpp-"$version".tgz -C "$scratch" package/llama/gitRelease.bundle
  commit=$(git bundle list-heads "$scratch/package/llama/gitRelease.bundle" | awk '$2 == "HEAD" {print $1}')
  [ -n "$commit" ] || die "node-llama-cpp@$version: the bundle has no HEAD"
  sed -i -e "s/^NODE_LLAMA_CPP_VERSION=.*/NODE_LLAMA_CPP_VERSION=$version/" \
         -e "s|^NODE_LLAMA_CPP_INTEGRITY=.*|NODE_LLAMA_CPP_INTEGRITY=$integrity|" \
         -e "s/^LLAMA_CPP_COMMIT=.*/LLAMA_CPP_COMMIT=$commit/" "$pin_file"
  say "pinned node-llama-cpp@$version, llama.cpp $commit (scripts/llama-cpp.pin)"
}

# The subresource-integrity string npm records for a tarball: sha512, base64.
sri_of() { python3 -c 'import base64,hashlib,sys; print("sha512-" + base64.b64encode(hashlib.sha512(open(sys.argv[1],"rb").read()).digest()).decode())' "$1"; }

with_kvshare=0
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  --with-kvshare) [ $# -eq 1 ] || { usage >&2; exit 2; }; with_kvshare=1 ;;
  --repin) [ $# -eq 2 ] || { usage >&2; exit 2; }; repin "$2"; exit 0 ;;
  "") ;;
  *) say "unknown argument $1"; usage >&2; exit 2 ;;
esac

# shellcheck source=llama-cpp.pin
. "$pin_file"
for tool in npm git cmake ninja python3 c++; do
  command -v "$tool" >/dev/null || die "$tool is not installed (scripts/install-deps.sh installs it)"
done

short=${LLAMA_CPP_COMMIT:0:12}
base="$cache/llama.cpp/$short"
tree="$base/stock"
mkdir -p "$tree"
exec 9>"$base/.lock"
flock 9   # one build of a tree at a time (CI and a developer's shell may race)

# 1. The package, checked against the pin.
tgz="$base/node-llama-cpp-$NODE_LLAMA_CPP_VERSION.tgz"
if [ ! -f "$tgz" ] || [ "$(sri_of "$tgz")" != "$NODE_LLAMA_CPP_INTEGRITY" ]; then
  say "fetching node-llama-cpp@$NODE_LLAMA_CPP_VERSION (about 35 MB) with npm pack"
  rm -f "$tgz"
  scratch=$(mktemp -d)
  (cd "$scratch" && npm pack --silent "node-llama-cpp@$NODE_LLAMA_CPP_VERSION" >/dev/null) ||
    die "npm pack node-llama-cpp@$NODE_LLAMA_CPP_VERSION failed (is the npm registry reachable?)"
  got=$(sri_of "$scratch/node-llama-cpp-$NODE_LLAMA_CPP_VERSION.tgz")
  if [ "$got" != "$NODE_LLAMA_CPP_INTEGRITY" ]; then
    rm -rf "$scratch"
    die "node-llama-cpp@$NODE_LLAMA_CPP_VERSION has integrity $got, scripts/llama-cpp.pin says $NODE_LLAMA_CPP_INTEGRITY"
  fi
  mv "$scratch/node-llama-cpp-$NODE_LLAMA_CPP_VERSION.tgz" "$tgz"
  rm -rf "$scratch"
fi

# 2. The source tree: a clone of the bundle at the pinned commit.
if [ "$(git -C "$tree/src" rev-parse HEAD 2>/dev/null || true)" != "$LLAMA_CPP_COMMIT" ]; then
  say "unpacking llama.cpp $short from the package's git bundle"
  scratch=$(mktemp -d)
  tar -xzf "$tgz" -C "$scratch" package/llama/gitRelease.bundle
  head=$(git bundle list-heads "$scratch/package/llama/gitRelease.bundle" | awk '$2 == "HEAD" {print $1}')
  if [ "$head" != "$LLAMA_CPP_COMMIT" ]; then
    rm -rf "$scratch"
    die "the bundle in node-llama-cpp@$NODE_LLAMA_CPP_VERSION is at ${head:-no commit}, scripts/llama-cpp.pin says $LLAMA_CPP_COMMIT"
  fi
  rm -rf "$tree/src"
  git -c advice.detachedHead=false clone -q "$scratch/package/llama/gitRelease.bundle" "$tree/src"
  git -C "$tree/src" checkout -q "$LLAMA_CPP_COMMIT"
  rm -rf "$scratch"
fi

# 3. The build. Everything off that llama-server does not need (no network client, no web UI
# download, no tests or examples); static, so the binary does not depend on the tree's
# shared libraries. Portable x86-64 flags (AVX2, FMA, F16C; no AVX-512, no AMX) rather than
# native ones: on a CPU with AMX, ggml routes q8_0 weights through its AMX matmul, which
# crashes (SIGSEGV in ggml_backend_amx_mul_mat) on the tiny generated models the tests serve
# (seen on a Xeon with amx_int8, node-llama-cpp 3.21.1); and every machine then tests the same
# code paths.
flags=(
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
)
targets=(llama-server)

# 3a. --with-kvshare: kvshare installed into the cache, the series applied to a sibling tree
# ($base/kvshare/src, a clone of the stock one) and one more CMake flag. The two trees sit
# at the same depth with the same src/build-<key> names, so with ccache's base dir at each
# tree every compile the series does not touch is a cache hit.
if [ "$with_kvshare" = 1 ]; then
  kbuild=${KVSHARE_BUILD_DIR:-$root/build}
  prefix="$base/kvshare/prefix"
  if [ ! -f "$kbuild/build.ninja" ]; then
    say "configuring kvshare in $kbuild"
    cmake -S "$root" -B "$kbuild" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null ||
      die "configuring kvshare in $kbuild failed"
  fi
  # Installing needs every library and tool; a build that has them does nothing here.
  # (the installed tools; kvshare-bench and the test helpers are not installed)
  ninja -C "$kbuild" -j "${KVSHARE_JOBS:-$(nproc)}" kvshare_c $(ninja -C "$kbuild" -t targets all |
    sed -n 's|^\(bin/kvshare-[a-z-]*\): .*|\1|p' | grep -v -e '^bin/kvshare-bench$' -e '^bin/kvshare-test-') >&2 ||
    die "building kvshare in $kbuild failed"
  cmake --install "$kbuild" --prefix "$prefix" >/dev/null || die "installing kvshare into $prefix failed"

  series_dir="$root/integrations/llama.cpp"
  series_key=$(cd "$series_dir" && cat series $(cat series) | sha256sum | cut -c1-16)
  ktree="$base/kvshare"
  if [ "$(cat "$ktree/src/.git/kvshare-series" 2>/dev/null || true)" != "$series_key" ]; then
    say "applying integrations/llama.cpp/series to a copy of llama.cpp $short"
    rm -rf "$ktree/src"
    git -c advice.detachedHead=false clone -q "$tree/src" "$ktree/src"
    git -C "$ktree/src" -c advice.detachedHead=false checkout -q "$LLAMA_CPP_COMMIT"
    while read -r patch; do
      [ -n "$patch" ] || continue
      git -C "$ktree/src" -c user.name=kvshare -c user.email=kvshare@invalid am -q "$series_dir/$patch" ||
        die "integrations/llama.cpp/$patch does not apply to llama.cpp $short (see integrations/llama.cpp/README.md, Rebasing)"
    done < "$series_dir/series"
    echo "$series_key" > "$ktree/src/.git/kvshare-series"
  fi
  tree=$ktree
  flags+=(-DLLAMA_KVSHARE=ON "-DCMAKE_PREFIX_PATH=$prefix")
  # The GPU decoder of the shared route (docs/llama-server.md, "Device caches"): one binary
  # serves both, -ngl 0 (or no visible device) is the CPU decoder. A Vulkan device of CPU
  # type (lavapipe) is used only when GGML_VK_VISIBLE_DEVICES names it, so the CPU tests
  # run as before. 0003 and 0004 of the series let Debian 12's glslc and headers build it.
  if [ "${KVSHARE_LLAMA_VULKAN:-1}" = 1 ]; then
    command -v glslc >/dev/null && [ -f /usr/include/vulkan/vulkan.h ] ||
      die "the Vulkan backend needs glslc and the Vulkan headers (scripts/install-deps.sh installs them; KVSHARE_LLAMA_VULKAN=0 builds without it)"
    flags+=(-DGGML_VULKAN=ON)
  fi
fi

key=$(printf '%s\n' "${flags[@]}" "$(c++ --version | head -1)" | sha256sum | cut -c1-12)
build="$tree/build-$key"
launcher=()
if command -v ccache >/dev/null; then
  export CCACHE_DIR=${CCACHE_DIR:-$cache/ccache} CCACHE_BASEDIR="$tree" CCACHE_NOHASHDIR=1
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
log="$build.log"
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$tree/src" -B "$build" -G Ninja "${flags[@]}" "${launcher[@]}" >"$log" 2>&1 ||
    { tail -n 30 "$log" >&2; die "configuring llama.cpp failed (log: $log)"; }
fi
jobs=${KVSHARE_JOBS:-$(nproc)}
start=$(date +%s)
if ! ninja -C "$build" -n "${targets[@]}" 2>/dev/null | grep -q "no work to do"; then
  say "building ${targets[*]} $short in $build (-j$jobs; about 10-30 minutes on 2 cores the first time)"
fi
# ninja's [done/total] lines, thinned to about one in twenty, are the progress report.
set +e
ninja -C "$build" -j "$jobs" "${targets[@]}" 2>&1 | tee "$log.build" |
  awk '/^\[[0-9]+\/[0-9]+\]/ { split(substr($1, 2), n, "/"); if (n[1] % 20 == 0 || n[1] == n[2]) { print "build-llama-server: " $1; fflush() } }' >&2
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  grep -B2 -A20 -m3 -E "FAILED|error:" "$log.build" >&2 || tail -n 40 "$log.build" >&2
  die "building llama-server failed (log: $log.build)"
fi
server="$build/bin/llama-server"
[ -x "$server" ] || die "the build finished but $server is missing"

# 4. --with-kvshare: llama-kvshare-prefill, out of the llama.cpp tree. libllama, its headers
# (llama-kvshare.h among them) and ggml are installed from the build above into
# $build-prefix: the top directory's install rules alone (CMAKE_INSTALL_LOCAL_ONLY) and
# ggml's, since the tools' rules want binaries this build does not make. The provider's
# sources are copied into the cache under a key of their content and the llama.cpp build's,
# so two kvshare trees with different providers never share a build; the binary is then put
# beside llama-server (renamed into place: a running copy keeps its file), where the tests,
# benches and demo look for it.
if [ "$with_kvshare" = 1 ]; then
  lprefix="$build-prefix"
  (cd "$build" && cmake -DCMAKE_INSTALL_LOCAL_ONLY=ON -DCMAKE_INSTALL_PREFIX="$lprefix" -P cmake_install.cmake &&
    cmake -DCMAKE_INSTALL_PREFIX="$lprefix" -P ggml/cmake_install.cmake) >>"$log" 2>&1 ||
    { tail -n 20 "$log" >&2; die "installing libllama into $lprefix failed (log: $log)"; }
  provider_dir="$root/integrations/llama.cpp/kvshare-prefill"
  pkey=$( (echo "$key"; cd "$provider_dir" && cat CMakeLists.txt kvshare-prefill.cpp) | sha256sum | cut -c1-12)
  pbase="$tree/prefill-$pkey"
  if [ ! -f "$pbase/build/build.ninja" ]; then
    rm -rf "$pbase"
    mkdir -p "$pbase/src"
    cp "$provider_dir/CMakeLists.txt" "$provider_dir/kvshare-prefill.cpp" "$pbase/src/"
    cmake -S "$pbase/src" -B "$pbase/build" -G Ninja -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$lprefix;$prefix" \
      "${launcher[@]}" >"$pbase/build.log" 2>&1 ||
      { tail -n 30 "$pbase/build.log" >&2; die "configuring llama-kvshare-prefill failed (log: $pbase/build.log)"; }
  fi
  ninja -C "$pbase/build" -j "$jobs" llama-kvshare-prefill >>"$pbase/build.log" 2>&1 ||
    { grep -B2 -A20 -m3 -E "FAILED|error:" "$pbase/build.log" >&2; die "building llama-kvshare-prefill failed (log: $pbase/build.log)"; }
  if ! cmp -s "$pbase/build/llama-kvshare-prefill" "$build/bin/llama-kvshare-prefill"; then
    cp "$pbase/build/llama-kvshare-prefill" "$build/bin/.llama-kvshare-prefill.new"
    mv -f "$build/bin/.llama-kvshare-prefill.new" "$build/bin/llama-kvshare-prefill"
  fi
fi
elapsed=$(( $(date +%s) - start ))
[ "$with_kvshare" = 0 ] || targets+=(llama-kvshare-prefill)
[ "$elapsed" -lt 5 ] || say "${targets[*]} built in ${elapsed}s"
echo "$server"
