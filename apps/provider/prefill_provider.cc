#include "apps/provider/prefill_provider.h"

#include "kvshare/share/decoder_share.h"

#include <fmt/format.h>

#include <charconv>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "apps/provider/prefill_routes.h"
#include "kvshare/fd.h"
#include "kvshare/share/provider_share.h"

namespace kvshare::refmodel {
namespace {

Result<std::string> read_text_file(const std::string& path, std::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return fail(errno, "{} {}: cannot open", what, path);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return fail(EIO, "{} {}: read failed", what, path);
  return ss.str();
}

struct Loaded {
  ProviderModel model;
  std::vector<int32_t> tokens;
};

// The ids file, then the model: a bad ids file is reported without loading the model.
Result<Loaded> load_inputs(const PrefillRequest& r) {
  auto ids_text = read_text_file(r.tokens_path, "ids file");
  if (!ids_text) return fail(ids_text.error());
  auto tokens = parse_token_ids(*ids_text, r.tokens_path);
  if (!tokens) return fail(tokens.error());
  auto model = load_provider_model(r.model_path);
  if (!model) return fail(model.error());
  return Loaded{std::move(*model), std::move(*tokens)};
}

IdsSource ids_file_source(const PrefillRequest& r) { return IdsSource{fmt::format("ids file {}", r.tokens_path)}; }

Error cached_on_file_route_error() {
  return Error(EINVAL,
               "--cached is for the shared route (--layout/--fds), where the region already holds the cached "
               "cells; the file route (--out) writes a state file of every id from position 0");
}

Error stream_on_file_route_error() {
  return Error(EINVAL,
               "--stream is for the shared route (--layout/--fds), where it names the decoder's KV stream "
               "(its slot); the file route (--out) writes one sequence's state file");
}

Error cells_on_file_route_error(const PrefillRequest& r) {
  return Error(EINVAL, fmt::format("{} is for the shared route (--layout/--fds), where it names the cells of the "
                                   "decoder's KV stream the share hands over; the file route (--out) writes one "
                                   "sequence's state file",
                                   r.first_cell ? "--first-cell" : "--cells"));
}

Result<PrefillReport> run_file_route(const PrefillRequest& r) {
  auto in = load_inputs(r);
  if (!in) return fail(in.error());
  PrivateContext own;
  return prefill_state_file(in->model, StateFileTarget{r.out_path, r.params, r.state_version}, in->tokens, r.n_threads,
                            ids_file_source(r), own);
}

Result<PrefillReport> run_shared_route(const PrefillRequest& r, std::vector<Fd> fds) {
  // The broker's header gives the KV params to build our own header from; ProviderShare
  // then checks the two against each other and imports the fds.
  auto theirs = read_header_file(r.layout_path);
  if (!theirs) return fail(theirs.error());
  auto in = load_inputs(r);
  if (!in) return fail(in.error());
  const IdsSource source = ids_file_source(r);
  if (auto known = check_ids_in_vocabulary(in->model, in->tokens, source); !known) return fail(known.error());
  auto ours = provider_share_header(in->model, theirs->params);
  if (!ours) return fail(ours.error());
  // Before the fds are imported: a prompt the region cannot take touches nothing.
  const uint32_t n_cached = r.n_cached.value_or(0);
  if (auto fits = check_region_fits(*theirs, in->tokens.size(), n_cached, source); !fits) return fail(fits.error());
  const uint32_t stream = r.stream.value_or(0);
  if (auto in_range = check_region_stream(*theirs, stream, n_cached, source); !in_range) return fail(in_range.error());
  // --first-cell C alone: the cells to the end of the stream.
  const ShareCells cells_named =
      resolve_share_cells(theirs->memory, ShareCells{stream, r.first_cell.value_or(0), r.n_cells.value_or(0)});
  const uint32_t first_cell = cells_named.first_cell, n_cells = cells_named.n_cells;
  if (auto cells = check_region_cells(*theirs, first_cell, n_cells, in->tokens.size(), n_cached, source); !cells)
    return fail(cells.error());
  if (fds.size() != theirs->layout.chunks.size())
    return fail(EINVAL, "--fds gives {} descriptors, layout header {} has {} chunks", fds.size(), r.layout_path,
                theirs->layout.chunks.size());
  std::vector<int> fd_numbers;
  for (Fd& fd : fds) fd_numbers.push_back(fd.release());  // ProviderShare::open owns them from here
  auto share = ProviderShare::open(r.layout_path, fd_numbers, *ours);
  if (!share) return fail(share.error().with_context(fmt::format("model {}", r.model_path)));
  // A fresh mapping: memfd chunks are written through their descriptors (chunk_file.h).
  const RegionTarget target{share->header(), share->imported(), share->imported().chunk_files(),
                            stream,          first_cell,        n_cells};
  PrivateContext own;
  return prefill_region(in->model, target, in->tokens, n_cached, r.n_threads, source, own);
}

}  // namespace

Result<std::vector<int32_t>> parse_token_ids(std::string_view text, std::string_view source) {
  std::vector<int32_t> ids;
  size_t first = text.find_first_not_of(" \t\r\n");
  if (first != std::string_view::npos && text[first] == '[') {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      return fail(EINVAL, "ids file {}: not a JSON array of ids: {}", source, e.what());
    }
    if (!j.is_array()) return fail(EINVAL, "ids file {}: not a JSON array of ids", source);
    for (size_t i = 0; i < j.size(); ++i) {
      const auto& v = j[i];
      if (!v.is_number_integer())
        return fail(EINVAL, "ids file {}: element {} is {}, not an integer id", source, i, v.dump());
      const int64_t id = v.get<int64_t>();
      if (id < 0 || id > INT32_MAX) return fail(EINVAL, "ids file {}: element {} is {}, not a valid id", source, i, id);
      ids.push_back(static_cast<int32_t>(id));
    }
  } else {
    size_t line_no = 0;
    size_t at = 0;
    while (at <= text.size()) {
      size_t end = text.find('\n', at);
      if (end == std::string_view::npos) end = text.size();
      std::string_view line = text.substr(at, end - at);
      ++line_no;
      at = end + 1;
      const size_t b = line.find_first_not_of(" \t\r");
      if (b == std::string_view::npos) continue;
      const size_t e = line.find_last_not_of(" \t\r");
      line = line.substr(b, e - b + 1);
      int64_t id = 0;
      auto [ptr, ec] = std::from_chars(line.data(), line.data() + line.size(), id);
      if (ec != std::errc() || ptr != line.data() + line.size() || line[0] == '+')
        return fail(EINVAL, "ids file {}: line {} is \"{}\", not a decimal token id", source, line_no,
                    line.substr(0, 40));
      if (id < 0 || id > INT32_MAX)
        return fail(EINVAL, "ids file {}: line {} id {} is not a valid id", source, line_no, id);
      ids.push_back(static_cast<int32_t>(id));
    }
  }
  if (ids.empty()) return fail(EINVAL, "ids file {}: holds no token ids", source);
  return ids;
}

Result<void> check_prefill_usage(const PrefillRequest& request) {
  if (request.stream && request.layout_path.empty()) return fail(stream_on_file_route_error());
  if ((request.first_cell || request.n_cells) && request.layout_path.empty())
    return fail(cells_on_file_route_error(request));
  if (request.stream && *request.stream > 0) {
    // An unreadable header is a failed prefill (exit 1), reported by run_prefill.
    if (auto header = read_header_file(request.layout_path); header) {
      if (auto in_range = check_region_stream(*header, *request.stream, 0, ids_file_source(request)); !in_range)
        return fail(in_range.error());
    }
  }
  if (!request.n_cached) return {};
  if (request.layout_path.empty()) return fail(cached_on_file_route_error());
  if (*request.n_cached == 0) return {};
  // An unreadable or malformed ids file is a failed prefill (exit 1), reported by
  // run_prefill with the line at fault; only the bound is usage.
  auto text = read_text_file(request.tokens_path, "ids file");
  if (!text) return {};
  auto ids = parse_token_ids(*text, request.tokens_path);
  if (!ids) return {};
  if (*request.n_cached >= ids->size())
    return fail(cached_bound_error(*request.n_cached, ids->size(), ids_file_source(request)));
  return {};
}

Result<PrefillReport> run_prefill(const PrefillRequest& request) {
  // Own the inherited descriptors before anything can fail: an early return closes them.
  std::vector<Fd> fds;
  for (int fd : request.fds) fds.emplace_back(fd);
  if (request.n_cached && request.layout_path.empty()) return fail(cached_on_file_route_error());
  if (request.stream && request.layout_path.empty()) return fail(stream_on_file_route_error());
  if ((request.first_cell || request.n_cells) && request.layout_path.empty())
    return fail(cells_on_file_route_error(request));
  if (!request.layout_path.empty()) {
    if (!request.out_path.empty())
      return fail(EINVAL, "--out and --layout exclude each other: pick the file or the shared route");
    return run_shared_route(request, std::move(fds));
  }
  if (!fds.empty()) return fail(EINVAL, "--fds needs --layout (the shared route)");
  if (request.out_path.empty()) return fail(EINVAL, "neither --out (file route) nor --layout (shared route) given");
  return run_file_route(request);
}

}  // namespace kvshare::refmodel
