// A hostile remote provider for the integration tests: given a decoder's offer (a file),
// it connects to the decoder's worker and tries to write where its share does not reach
// — the first cell past the grant, another share_id, the granted cells with the right
// share_id but a wrong secret (a forger who saw the share_id), a chunk that does not
// exist, the padding at a chunk's end, a garbage header. Prints one line per attempt;
// exits 0 when the decoder refused every one, 1 when any write was accepted, 2 on bad
// usage.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "kvshare/remote/remote_offer.h"
#include "kvshare/remote/remote_sender.h"
#include "kvshare/remote/ucx_common.h"

using namespace kvshare;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OFFER.json\n", argv[0]);
    return 2;
  }
  std::ifstream in(argv[1]);
  std::stringstream text;
  text << in.rdbuf();
  auto offer = remote::parse_offer_text(text.str(), argv[1]);
  if (!offer) {
    std::fprintf(stderr, "attack peer: %s\n", offer.error().what().c_str());
    return 2;
  }
  const layout::SharedTensor* k0 = offer->header.layout.find(0, 0, layout::TensorKind::k);
  const uint64_t row = k0->tensor.row_bytes;
  // Cell c of the offer's stream of layer 0's K (stream s starts s * kv_size rows in).
  const uint64_t kv_size = offer->header.memory.kv_caches.front().kv_size;
  const auto cell = [&](uint64_t c) { return k0->offset + (offer->stream * kv_size + c) * row; };
  const uint64_t first_granted = cell(offer->first_cell + offer->n_cached);
  const uint64_t chunk_end = offer->header.layout.chunks[k0->chunk].size_bytes;
  std::vector<std::byte> rows(row, std::byte{0xee});
  std::vector<std::byte> garbage(13, std::byte{0x42});
  struct Attempt {
    const char* what;
    layout::RemoteWrite write;
    bool raw = false;
  };
  const layout::RemoteSecret secret = offer->secret;
  layout::RemoteSecret wrong_secret = secret;
  wrong_secret[0] ^= std::byte{0x80};
  const std::vector<Attempt> attempts = {
      {"the first cell past the grant",
       {offer->share_id, secret, k0->chunk, cell(offer->first_cell + offer->n_cells), row}},
      {"the granted cells under another share_id", {offer->share_id ^ 0x5555, secret, k0->chunk, first_granted, row}},
      {"the granted cells with the share_id and a wrong secret",
       {offer->share_id, wrong_secret, k0->chunk, first_granted, row}},
      {"a chunk that does not exist", {offer->share_id, secret, 4242, 0, row}},
      {"the end of the chunk", {offer->share_id, secret, k0->chunk, chunk_end - row / 2, row}},
      {"a 13-byte garbage header", {}, true},
  };
  int accepted = 0;
  for (const Attempt& a : attempts) {
    // A fresh endpoint each time: a refusal must not depend on an earlier one.
    auto sender = remote::RemoteSender::connect(offer->worker_address);
    if (!sender) {
      std::fprintf(stderr, "attack peer: %s\n", sender.error().what().c_str());
      return 2;
    }
    auto posted = a.raw ? (*sender)->send_raw(remote::kAmWrite, garbage, rows) : (*sender)->write(a.write, rows);
    auto flushed = posted ? (*sender)->flush(std::chrono::steady_clock::now() + std::chrono::seconds(10)) : posted;
    if (flushed) {
      std::printf("ACCEPTED: %s\n", a.what);
      ++accepted;
    } else {
      std::printf("refused: %s (%s)\n", a.what, flushed.error().what().c_str());
    }
  }
  std::fflush(stdout);
  return accepted == 0 ? 0 : 1;
}
