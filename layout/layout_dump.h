// What kvshare-layout-dump prints: the region a decoder would export for a model and KV
// params (every tensor's place, every chunk's size and hash, totals), or the layout
// header itself; and the check of a header file. Pure: the tool maps the files.
#pragma once

#include <string>
#include <string_view>

#include "layout/error.h"
#include "layout/gguf_reader.h"
#include "layout/kv_params.h"
#include "layout/share_header.h"

namespace kvshare::layout {

// The header for a parsed GGUF (weights not needed: shape-only files work) and params.
// Fails on an unsupported arch, a missing key or params llama.cpp refuses, naming the file.
Result<ShareHeader> header_for_model(const GgufFile& file, const KvParams& params);

// A human-readable report of `header`: one line per tensor (name, type, shape, chunk,
// offset, padded size), one per chunk (cache object, size, hash), totals in bytes and MiB,
// and the KV bytes one token takes.
std::string render_layout_report(const ShareHeader& header);

// The report for a model file, or the header JSON when `as_json`.
Result<std::string> render_layout_dump(const GgufFile& file, const KvParams& params, bool as_json);

// Decodes and validates a header document (`source` names it in errors); on success a
// report of what it describes.
Result<std::string> render_header_check(std::string_view json, std::string_view source);

}  // namespace kvshare::layout
