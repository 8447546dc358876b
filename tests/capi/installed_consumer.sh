#!/bin/sh
# Usage: installed_consumer.sh BUILD_DIR CONSUMER_C PREFIX
# Installs the build into PREFIX, compiles CONSUMER_C as C11 with only
# `pkg-config kvshare-c`, and runs it.
set -eu
build=$1 source=$2 prefix=$3
rm -rf "$prefix"
cmake --install "$build" --prefix "$prefix" >/dev/null
pc_dir=$(dirname "$(find "$prefix" -name kvshare-c.pc | head -1)")
flags=$(PKG_CONFIG_PATH=$pc_dir pkg-config --cflags --libs kvshare-c)
libdir=$(PKG_CONFIG_PATH=$pc_dir pkg-config --variable=libdir kvshare-c)
${CC:-cc} -std=c11 -Wall -Wextra -Werror -pedantic -o "$prefix/kvshare-c-consumer" "$source" $flags
LD_LIBRARY_PATH=$libdir "$prefix/kvshare-c-consumer"
