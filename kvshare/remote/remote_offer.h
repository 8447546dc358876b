// The offer: what the decoder answers `POST /slots/0?action=share {"transport":"ucx"}`
// with, and what a remote provider needs to write the share — the decoder's UCX worker
// address, the layout header, the share_id and the share's secret (every message must
// carry both), which cells of which stream are granted, the byte count and layout hash the
// completion must repeat, and how long the grant lives. JSON, so it rides inside the HTTP bodies
// unchanged (docs/remote.md, "The offer"). The secret is a capability: whoever holds the
// offer can write the granted cells, so it goes only to the provider asked to prefill.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "layout/error.h"
#include "layout/remote_grant.h"
#include "layout/remote_message.h"
#include "layout/share_header.h"

namespace kvshare::remote {

inline constexpr std::string_view kTransportUcx = "ucx";
// 3: the grant names its stream, first cell and the positions the decoder keeps
// (n_cached); version 2 granted cells 0..n_cells-1 of one stream, version 1 had no
// "secret": both are refused by name.
inline constexpr uint32_t kOfferVersion = 3;
// A UCX 1.13 worker address is 50-186 bytes here; a few interfaces more stay far below.
inline constexpr size_t kMaxWorkerAddressBytes = 4096;
inline constexpr size_t kMaxOfferBytes = size_t{16} << 20;

struct RemoteOffer {
  uint32_t version = kOfferVersion;
  uint64_t share_id = 0;                  // random: every message names the share with it
  layout::RemoteSecret secret{};          // 128 random bits: every message must carry them
  std::vector<std::byte> worker_address;  // ucp_worker_get_address, opaque
  // The grant: positions n_cached..n_cells-1 of the prompt, position p in cell
  // first_cell + p of `stream`, in every K/V tensor. Positions 0..n_cached-1 are the
  // decoder's (it holds them); the provider attends over them but writes none.
  uint32_t stream = 0;
  uint32_t first_cell = 0;
  uint32_t n_cached = 0;
  uint32_t n_cells = 0;
  uint64_t bytes = 0;        // layout::granted_bytes for the granted cells
  uint64_t layout_hash = 0;  // layout::whole_layout_hash
  uint64_t timeout_ms = 0;   // the grant ends this long after the share answered
  layout::ShareHeader header;
};

nlohmann::ordered_json to_json(const RemoteOffer& offer);

// The cells the offer grants (layout::grant_cells over its header). The offer must have
// passed parse_offer (or been made by the receiver); otherwise the error names the field.
Result<layout::CellGrant> offer_grant(const RemoteOffer& offer);

// Parses and checks an offer (EINVAL naming the field): transport "ucx", a version this
// side speaks, a "secret" of 32 lowercase hex digits (not all zero; a refusal never shows
// it), a hex worker address of at most kMaxWorkerAddressBytes, a valid layout header
// (layout::parse_share_header_document), a grant the header can hold (layout::grant_cells:
// stream < n_stream, n_cached < n_cells, first_cell + n_cells within kv_size), and bytes
// and layout_hash equal to what the header gives for the granted cells — a provider
// refuses before connecting, so an incompatible peer fails fast and no byte moves.
Result<RemoteOffer> parse_offer(const nlohmann::json& json, std::string_view source);
Result<RemoteOffer> parse_offer_text(std::string_view text, std::string_view source);

std::string to_hex(const std::vector<std::byte>& bytes);

}  // namespace kvshare::remote
