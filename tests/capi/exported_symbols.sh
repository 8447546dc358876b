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
# Each symbol carries the version of the node that lists it (kvshare_provider_write_state@@KVSHARE_1.2):
# a function moved to another node would break every binary linked against the old one.
versioned=$(nm -D --defined-only "$lib" | awk '{print $3}' | grep '@@KVSHARE_' | sort -u)
expected=$(awk '/^KVSHARE_[0-9.]+ *\{/ {node=$1} /^ *kvshare_[a-z0-9_]*;/ {sub(/;.*/, ""); sub(/^ */, ""); print $0 "@@" node}' "$map" | sort -u)
misplaced=$(printf '%s\n' "$expected" | grep -vx -F "$versioned" || true)
if [ -n "$misplaced" ]; then echo "not exported with the version node $map lists them in:"; echo "$misplaced"; exit 1; fi
echo "$(printf '%s\n' "$listed" | wc -l) symbols, all in $map"
