#!/usr/bin/env bash
# Installs every Debian package kvshare builds, tests, fuzzes and benchmarks with.
# The one place the dependency list lives: .ci/run and the README call this script.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git python3 curl
  ccache                              # the real llama-server's build (scripts/build-llama-server.sh)
  clang libclang-rt-14-dev            # libFuzzer targets and the ASan+UBSan build
  clang-format                        # scripts/check-format.sh, the format_check test
  libfmt-dev nlohmann-json3-dev libcli11-dev libexpected-dev libcpp-httplib-dev libucx-dev
  liburing-dev libdrm-dev libopenblas-dev
  iproute2                            # ip netns: the remote route's two-namespace test
  libvulkan-dev glslc glslang-tools spirv-headers  # the patched llama-server's Vulkan backend
  mesa-vulkan-drivers vulkan-tools    # lavapipe, the Vulkan device on the CPU the GPU-decoder tests run on
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-matplotlib                  # scripts/plot-bench.py: the benchmark plots in docs/
)
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# npm fetches the pinned llama.cpp (node-llama-cpp). Machines that ship Node.js from elsewhere
# have npm inside their nodejs package, and Debian's npm would conflict with it: only a
# machine with no npm command at all gets Debian's.
command -v npm >/dev/null || missing+=(npm)
if [ "${#missing[@]}" -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# XRT (libxrt-dev, Debian bookworm and later) by default, so the xrt::bo import builds and
# its no-device path is tested everywhere; KVSHARE_WITH_XRT=0 leaves it out. A release
# without the package builds without XRT and says so.
if [ "${KVSHARE_WITH_XRT:-1}" = "1" ] && ! dpkg-query -W -f='${Status}' libxrt-dev 2>/dev/null | grep -q "install ok installed"; then
  if apt-cache policy libxrt-dev 2>/dev/null | grep -q "Candidate: [0-9]"; then
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends libxrt-dev
  else
    echo "install-deps: this Debian has no libxrt-dev; building without XRT"
  fi
fi
echo "install-deps: all packages present"
