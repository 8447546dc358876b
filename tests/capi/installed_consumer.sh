#!/bin/sh
# Usage: installed_consumer.sh BUILD_DIR CONSUMER_C PREFIX
# Installs the build into PREFIX, compiles CONSUMER_C as C11 with only
# `pkg-config kvshare-c`, and runs it.
set -eu
build=$1 source=$2 prefix=$3
rm -rf "$prefix"
cmake --install "$build" --prefix "$prefix" >/dev/null
pc_dir=$(dirname "$(find "$prefix" -name kvshare-c.pc | head -1)")
# The .pc file names the configured prefix; the package was installed elsewhere.
pc() { PKG_CONFIG_PATH=$pc_dir pkg-config --define-variable=prefix="$prefix" "$@" kvshare-c; }
flags=$(pc --cflags --libs)
libdir=$(pc --variable=libdir)
${CC:-cc} -std=c11 -Wall -Wextra -Werror -pedantic -o "$prefix/kvshare-c-consumer" "$source" $flags
LD_LIBRARY_PATH=$libdir "$prefix/kvshare-c-consumer"
