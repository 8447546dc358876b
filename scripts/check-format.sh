#!/usr/bin/env bash
# check-format: every C and C++ source of the tree is as clang-format (the .clang-format
# files) writes it. Run by CTest as format_check; `scripts/check-format.sh --fix` rewrites
# the files instead. Exit 1 naming each file that differs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
command -v clang-format >/dev/null || { echo "check-format: clang-format is not installed (scripts/install-deps.sh)"; exit 2; }
mapfile -t files < <(find layout kvshare xdna refmodel route apps capi tools tests \
  \( -name '*.cc' -o -name '*.h' -o -name '*.c' \) -not -path 'tests/data/*' | sort)
if [ "${1:-}" = --fix ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  clang-format --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  printf 'check-format: not as clang-format writes it: %s\n' "${bad[@]}" >&2
  echo "check-format: ${#bad[@]} of ${#files[@]} files; scripts/check-format.sh --fix rewrites them" >&2
  exit 1
fi
echo "check-format: ${#files[@]} files as clang-format writes them"
