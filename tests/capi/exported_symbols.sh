#!/bin/sh
# Usage: exported_symbols.sh LIBRARY VERSION_SCRIPT
# Fails when the library exports a symbol the version script does not list, or lacks one
# it lists: every ABI change must be a visible diff of the script.
set -eu
lib=$1 map=$2
exported=$(nm -D --defined-only "$lib" | awk '$2 ~ /^[TWDBVR]$/ {print $3}' | sed 's/@.*//' | sort -u)
listed=$(sed -n 's/^ *\(kvshare_[a-z0-9_]*\);.*/\1/p' "$map" | sort -u)
extra=$(printf '%s\n' "$exported" | grep -vx -F "$listed" | grep -v '^KVSHARE_' || true)
missing=$(printf '%s\n' "$listed" | grep -vx -F "$exported" || true)
if [ -n "$extra" ]; then echo "exported but not in $map:"; echo "$extra"; exit 1; fi
if [ -n "$missing" ]; then echo "in $map but not exported:"; echo "$missing"; exit 1; fi
nm -D --defined-only "$lib" | grep -q 'kvshare_decoder_open@@KVSHARE_1.0' || {
  echo "kvshare_decoder_open is not versioned KVSHARE_1.0"; exit 1; }
echo "$(printf '%s\n' "$listed" | wc -l) symbols, all in $map"
