// llama-kvshare-prefill: the reference prefill provider of kvshare's hybrid route, on
// llama.cpp's libllama, so decoder and provider run the same code and the handed-over KV is
// the decoder's own computation, byte for byte. Built out of the llama.cpp tree against an
// installed libllama with the series applied (llama.h, llama-kvshare.h) and kvshare's C API.
//
//   file route:   llama-kvshare-prefill --tokens IDS --out STATE --model GGUF
//                 [--ctx-size N --flash-attn on|off|auto --cache-type-k T --cache-type-v T]
//   shared route: llama-kvshare-prefill --tokens IDS --model GGUF --layout HEADER --fds N[,N...] [--cached P]
//                 [--stream S] [--first-cell C --cells N]
//   resident:     llama-kvshare-prefill --model GGUF (--serve-fd N | --serve PATH)
//
// --cached P (incremental handoff): the decoder's cells 0..P-1 already hold ids 0..P-1 of
// the file as positions 0..P-1 (its slot's cached prefix); the provider marks them so,
// computes ids P.. attending over them and writes only cells P...
//
// --stream S: the decoder's cache keeps one stream per slot (-np N without --kv-unified)
// and the share is for slot S's: the context has the decoder's n_seq_max and kv_unified
// (the header's), so its tensors are the whole region, and the ids are decoded as its
// sequence S, which writes stream S only. Default 0. A resident provider takes S from each
// shared prefill request.
//
// --first-cell C --cells N: the decoder's cache is unified over several slots (--kv-unified,
// llama-server's -np auto) and the share is for the run of cells it reserved for the slot:
// id p goes to cell C + p (at most N ids). This context's cells 0..C-1 are marked as
// another sequence's (metadata only, never decoded; llama_kvshare_provider_skip_cells), so
// llama.cpp places the ids at C..C+n-1 and writes no other cell (the other slots'). A
// resident provider takes the range from each shared prefill request (kvshare_resident_cells).
//
// The shared route places this process's KV cache in the decoder's regions (the fds a
// kvshare broker passed; llama_kvshare_init_provider) and prefills into them: no file,
// no copy. Either way the last line on stdout is {"prefill_ms": X, "n_prefilled": N}.
// Exit 0 ok, 1 failed, 2 bad usage.
//
// Resident (kvshare's resident provider protocol, through its C API kvshare_resident_*):
// the model is loaded once and kvshare-serve's requests are taken on the socket it passed
// (--serve-fd) or from each serve that connects to PATH (--serve, a 0700 directory of
// ours). A region request places one context's cache in the decoder's region, mapped in
// once; each shared prefill then resets that context's cell metadata (never the bytes: they
// are the decoder's) and decodes into it. A file prefill uses a private context, kept while
// the requested KV params stay the same. Failures are error replies; the process serves on
// until serve closes the channel (--serve-fd: exit 0) or a signal ends it.
#include "llama.h"
#include "llama-kvshare.h"

#include <kvshare.h>
#include <csignal>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct options {
    std::string tokens, out, model, layout, fds, elfs, cached, stream, first_cell, n_cells;
    std::string serve_fd, serve;  // resident: serve's socket pair end, or the path to listen on
    int         n_ctx = 4096;
    std::string flash_attn = "auto", type_k = "f16", type_v = "f16";
    int         n_threads = 0;
    int         n_gpu_layers = -1; // llama.cpp's default: every layer on the GPU when one is visible
    int         n_seq_max = 1;     // file route: the decoder's -np (a state file has one stream per slot)
    bool        kv_unified = false;
    bool        verbose = false;
};

void usage(const char * argv0) {
    fprintf(stderr,
            "usage: %s --tokens IDS --model GGUF (--out STATE | --layout HEADER --fds N[,N...] [--cached P] [--stream S])\n"
            "          [-c|--ctx-size N] [-fa|--flash-attn on|off|auto] [-ctk|--cache-type-k T] [-ctv|--cache-type-v T]\n"
            "          [-np|--parallel N] [-kvu|--kv-unified] [-t|--threads N] [-ngl|--gpu-layers N|auto|all] [--elfs DIR] [-v]\n"
            "       %s --model GGUF (--serve-fd N | --serve PATH) [-t|--threads N] [-ngl|--gpu-layers N|auto|all] [--elfs DIR] [-v]\n"
            "Prefills the ids (one decimal id per line, or a JSON array) and writes the KV as a llama.cpp\n"
            "sequence-state file (--out) or into a kvshare decoder's shared region (--layout/--fds, whose\n"
            "header fixes the KV params). --cached P (shared route only, 0 <= P < the number of ids): the\n"
            "decoder's cells 0..P-1 already hold ids 0..P-1 as positions 0..P-1; only ids P.. are computed\n"
            "and only cells P.. written. --stream S (shared route only, default 0): the share is for the decoder's\n"
            "stream S (slot S of a cache with one stream per slot); the ids are decoded as sequence S, into it.\n"
            "--first-cell C --cells N (shared route only): the share is for cells C..C+N-1 of a unified cache of\n"
            "several slots; id p is written at cell C + p, no other cell is (at most N ids, no --cached).\n"
            "Prints {\"prefill_ms\": X, \"n_prefilled\": N} (N: ids computed).\n"
            "--serve-fd N / --serve PATH: a resident provider: loads the model once and takes kvshare-serve's\n"
            "requests (a region, then shared or file prefills) on socket N, or from each serve that connects to\n"
            "PATH (its directory private, 0700), until serve closes the channel.\n"
            "-ngl N|auto|all (as llama-server's): layers on the GPU, default auto (all when a GPU is visible; a\n"
            "Vulkan device of CPU type, such as lavapipe, only when GGML_VK_VISIBLE_DEVICES names it). On the shared\n"
            "route the device's layers keep their KV in the decoder's region, imported by the device.\n",
            argv0, argv0);
}

bool parse_args(int argc, char ** argv, options & o) {
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto value = [&](std::string & dst) {
            if (i + 1 >= argc) {
                fprintf(stderr, "llama-kvshare-prefill: %s needs a value\n", a.c_str());
                return false;
            }
            dst = argv[++i];
            return true;
        };
        std::string number;
        if (a == "-h" || a == "--help") { usage(argv[0]); exit(0); }
        else if (a == "--tokens") { if (!value(o.tokens)) return false; }
        else if (a == "--out") { if (!value(o.out)) return false; }
        else if (a == "--model" || a == "-m") { if (!value(o.model)) return false; }
        else if (a == "--layout") { if (!value(o.layout)) return false; }
        else if (a == "--fds") { if (!value(o.fds)) return false; }
        else if (a == "--cached") { if (!value(o.cached)) return false; }
        else if (a == "--stream") { if (!value(o.stream)) return false; }
        else if (a == "--first-cell") { if (!value(o.first_cell)) return false; }
        else if (a == "--cells") { if (!value(o.n_cells)) return false; }
        else if (a == "--serve-fd") { if (!value(o.serve_fd)) return false; }
        else if (a == "--serve") { if (!value(o.serve)) return false; }
        else if (a == "--elfs") { if (!value(o.elfs)) return false; } // accepted: a CPU prefill needs no NPU kernels
        else if (a == "-c" || a == "--ctx-size") { if (!value(number)) return false; o.n_ctx = atoi(number.c_str()); }
        else if (a == "-t" || a == "--threads") { if (!value(number)) return false; o.n_threads = atoi(number.c_str()); }
        else if (a == "-fa" || a == "--flash-attn") { if (!value(o.flash_attn)) return false; }
        else if (a == "-ctk" || a == "--cache-type-k") { if (!value(o.type_k)) return false; }
        else if (a == "-ctv" || a == "--cache-type-v") { if (!value(o.type_v)) return false; }
        else if (a == "-np" || a == "--parallel") { if (!value(number)) return false; o.n_seq_max = atoi(number.c_str()); }
        else if (a == "-kvu" || a == "--kv-unified") { o.kv_unified = true; }
        else if (a == "-ngl" || a == "--gpu-layers" || a == "--n-gpu-layers") {
            if (!value(number)) return false;
            if (number == "auto") { o.n_gpu_layers = -1; }
            else if (number == "all") { o.n_gpu_layers = -2; }
            else if (!number.empty() && number.size() <= 6 && number.find_first_not_of("0123456789") == std::string::npos) {
                o.n_gpu_layers = atoi(number.c_str());
            } else {
                fprintf(stderr, "llama-kvshare-prefill: %s %s: not a count of layers, 'auto' or 'all'\n", a.c_str(),
                        number.c_str());
                return false;
            }
        }
        else if (a == "-v" || a == "--verbose") { o.verbose = true; }
        else {
            fprintf(stderr, "llama-kvshare-prefill: unknown argument %s\n", a.c_str());
            return false;
        }
    }
    if (!o.serve_fd.empty() || !o.serve.empty()) {
        // resident: every request says its ids and route; only the model and threads are flags
        if (o.model.empty() || (!o.serve_fd.empty() && !o.serve.empty()) || !o.tokens.empty() || !o.out.empty() ||
            !o.layout.empty() || !o.fds.empty() || !o.cached.empty() || !o.stream.empty() || !o.first_cell.empty() ||
            !o.n_cells.empty()) {
            fprintf(stderr, "llama-kvshare-prefill: --serve-fd and --serve take --model and no --tokens, --out, --layout, "
                            "--fds, --cached, --stream, --first-cell or --cells (serve's requests carry them), and only "
                            "one of the two\n");
            return false;
        }
        if (!o.serve_fd.empty() && (o.serve_fd.find_first_not_of("0123456789") != std::string::npos ||
                                    o.serve_fd.size() > 9 || atoi(o.serve_fd.c_str()) < 3)) {
            fprintf(stderr, "llama-kvshare-prefill: --serve-fd %s: not a descriptor number >= 3\n", o.serve_fd.c_str());
            return false;
        }
        return true;
    }
    const bool shared = !o.layout.empty() || !o.fds.empty();
    if (o.tokens.empty() || o.model.empty() || (shared ? (o.layout.empty() || o.fds.empty() || !o.out.empty()) : o.out.empty())) {
        fprintf(stderr, "llama-kvshare-prefill: give --tokens and --model, and either --out or both --layout and --fds\n");
        return false;
    }
    if (!o.cached.empty()) {
        if (!shared) {
            fprintf(stderr, "llama-kvshare-prefill: --cached is for the shared route (--layout and --fds) only\n");
            return false;
        }
        if (o.cached.find_first_not_of("0123456789") != std::string::npos || o.cached.size() > 9) {
            fprintf(stderr, "llama-kvshare-prefill: --cached %s: not a count of tokens\n", o.cached.c_str());
            return false;
        }
    }
    if (!o.stream.empty()) {
        if (!shared) {
            fprintf(stderr, "llama-kvshare-prefill: --stream is for the shared route (--layout and --fds) only\n");
            return false;
        }
        if (o.stream.find_first_not_of("0123456789") != std::string::npos || o.stream.size() > 4) {
            fprintf(stderr, "llama-kvshare-prefill: --stream %s: not a stream number\n", o.stream.c_str());
            return false;
        }
    }
    for (const std::string * v : {&o.first_cell, &o.n_cells}) {
        if (v->empty()) {
            continue;
        }
        if (!shared) {
            fprintf(stderr, "llama-kvshare-prefill: --first-cell and --cells are for the shared route (--layout and --fds) only\n");
            return false;
        }
        if (v->find_first_not_of("0123456789") != std::string::npos || v->size() > 9) {
            fprintf(stderr, "llama-kvshare-prefill: --first-cell / --cells %s: not a cell count\n", v->c_str());
            return false;
        }
    }
    if (!o.first_cell.empty() && (o.n_cells.empty() || atol(o.n_cells.c_str()) == 0)) {
        fprintf(stderr, "llama-kvshare-prefill: --first-cell needs --cells N (N >= 1), the share's run of cells\n");
        return false;
    }
    if (!o.n_cells.empty() && !o.cached.empty() && atol(o.cached.c_str()) > 0) {
        fprintf(stderr, "llama-kvshare-prefill: --cached and --cells: a share of a run of cells has no cached prefix\n");
        return false;
    }
    if (o.n_seq_max < 1 || o.n_seq_max > 256) {
        fprintf(stderr, "llama-kvshare-prefill: --parallel %d: expected the decoder's slots, 1..256\n", o.n_seq_max);
        return false;
    }
    if (o.flash_attn != "on" && o.flash_attn != "off" && o.flash_attn != "auto") {
        fprintf(stderr, "llama-kvshare-prefill: --flash-attn %s: not one of on, off, auto\n", o.flash_attn.c_str());
        return false;
    }
    return true;
}

// The ids file: decimal ids separated by anything else (newlines, or a JSON array's commas).
bool read_ids(const std::string & path, std::vector<llama_token> & ids) {
    std::ifstream in(path);
    if (!in) {
        fprintf(stderr, "llama-kvshare-prefill: ids file %s: %s\n", path.c_str(), strerror(errno));
        return false;
    }
    std::stringstream text;
    text << in.rdbuf();
    const std::string s = text.str();
    for (size_t i = 0; i < s.size();) {
        if (s[i] >= '0' && s[i] <= '9') {
            size_t end = i;
            while (end < s.size() && s[end] >= '0' && s[end] <= '9') ++end;
            ids.push_back((llama_token) strtol(s.substr(i, end - i).c_str(), nullptr, 10));
            i = end;
        } else if (s[i] == '-') {
            fprintf(stderr, "llama-kvshare-prefill: ids file %s: negative id at byte %zu\n", path.c_str(), i);
            return false;
        } else {
            ++i;
        }
    }
    if (ids.empty()) {
        fprintf(stderr, "llama-kvshare-prefill: ids file %s holds no ids\n", path.c_str());
        return false;
    }
    return true;
}

bool cache_type(const std::string & name, ggml_type & out) {
    for (ggml_type t : {GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1,
                        GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1}) {
        if (name == ggml_type_name(t)) {
            out = t;
            return true;
        }
    }
    fprintf(stderr, "llama-kvshare-prefill: cache type %s: not one llama-server accepts\n", name.c_str());
    return false;
}

// The shared route's context: the header's KV params are the decoder's, whatever flags
// say. Its n_ubatch (with swa_full) sizes an iSWA model's SWA cache, whose tensors must
// match the decoder's, so that is the decoder's too (512 when the header has none).
void set_shared_params(llama_context_params & cparams, const llama_kvshare_kv_params & kv) {
    cparams.n_ctx           = kv.n_ctx;
    cparams.n_seq_max       = kv.n_seq_max;
    cparams.type_k          = (ggml_type) kv.type_k;
    cparams.type_v          = (ggml_type) kv.type_v;
    cparams.flash_attn_type = kv.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cparams.kv_unified      = kv.kv_unified;
    cparams.n_ubatch        = kv.n_ubatch != 0 ? kv.n_ubatch : 512;
    cparams.swa_full        = kv.swa_full;
    cparams.n_batch         = std::max<uint32_t>(512, cparams.n_ubatch);
}

// The file route's context: the decoder's -c, -ctk, -ctv, -fa (a file's bytes follow them),
// llama.cpp's default micro-batch.
void set_file_params(llama_context_params & cparams, uint32_t n_ctx, ggml_type type_k, ggml_type type_v,
                     llama_flash_attn_type flash_attn, uint32_t n_seq_max, bool kv_unified) {
    // the decoder's slots: a sequence-state file records every stream of the cache, and
    // llama-server restores only a file of its own stream count (sequence 0 is in stream 0)
    cparams.n_seq_max       = std::max<uint32_t>(1, n_seq_max);
    cparams.kv_unified      = kv_unified || cparams.n_seq_max == 1;
    cparams.n_ctx           = n_ctx;
    cparams.type_k          = type_k;
    cparams.type_v          = type_v;
    cparams.flash_attn_type = flash_attn;
    cparams.n_ubatch        = 512;
    cparams.n_batch         = 512;
}

// The streams of the decoder's cache, one per sequence unless unified: a shared prefill for
// stream S decodes as sequence S, which llama.cpp puts in stream S.
uint32_t n_streams(const llama_kvshare_kv_params & kv) {
    return kv.kv_unified || kv.n_seq_max == 0 ? 1 : kv.n_seq_max;
}

// Decodes ids first..n_ids-1 at positions first.. as sequence `seq`, n_batch at a time (as
// llama_batch_get_one: the last id of each batch is an output); "" or what failed.
std::string decode_seq(llama_context * ctx, const llama_token * ids, size_t n_ids, size_t first, uint32_t n_batch,
                       llama_seq_id seq) {
    llama_batch batch = llama_batch_init((int32_t) n_batch, 0, 1);
    std::string failed;
    for (size_t i = first; i < n_ids && failed.empty(); i += n_batch) {
        const int32_t n = (int32_t) std::min<size_t>(n_batch, n_ids - i);
        for (int32_t j = 0; j < n; ++j) {
            batch.token[j]     = ids[i + j];
            batch.pos[j]       = (llama_pos) (i + j);
            batch.n_seq_id[j]  = 1;
            batch.seq_id[j][0] = seq;
            batch.logits[j]    = j == n - 1;
        }
        batch.n_tokens = n;
        const int rc = llama_decode(ctx, batch);
        if (rc != 0) {
            failed = "llama_decode of ids " + std::to_string(i) + ".." + std::to_string(i + n - 1) + " failed (" +
                     std::to_string(rc) + ")";
        }
    }
    llama_batch_free(batch);
    llama_synchronize(ctx);
    return failed;
}

void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_WARN) {
        fputs(text, stderr);
    }
}

// The resident provider: one model, and at most two contexts kept between requests.
struct resident {
    llama_model *   model = nullptr;
    int             n_threads = 0;
    int32_t         n_vocab = 0;
    llama_context * shared_ctx = nullptr;  // its cache placed in the region held
    uint32_t        shared_n_batch = 512;
    uint32_t        shared_streams = 1;    // the decoder's streams: a prefill's stream is its sequence
    llama_context * file_ctx = nullptr;    // private, made for file_kv
    kvshare_kv_params file_kv = {};
    char            error[2048] = "";

    // The region's context goes first: its cache is the decoder's, released by finish.
    void drop_region() {
        if (shared_ctx != nullptr) {
            llama_free(shared_ctx);
            shared_ctx = nullptr;
        }
        llama_kvshare_provider_finish();
    }
    ~resident() {
        drop_region();
        if (file_ctx != nullptr) {
            llama_free(file_ctx);
        }
    }
    llama_context * make_context(llama_context_params cparams) {
        if (n_threads > 0) {
            cparams.n_threads = cparams.n_threads_batch = n_threads;
        }
        return llama_init_from_model(model, cparams);
    }
};

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

int reply_error(kvshare_resident * r, int errnum, const std::string & message) {
    return kvshare_resident_reply_error(r, errnum, message.c_str());
}

// The ids fit the context (a sequence's cells) and the vocabulary, else why not.
std::string check_ids(const resident & res, const kvshare_resident_request & q, uint32_t n_ctx) {
    if (n_ctx != 0 && q.n_tokens >= n_ctx) {
        return std::to_string(q.n_tokens) + " tokens do not fit a context of " + std::to_string(n_ctx) + " cells";
    }
    for (uint32_t i = 0; i < q.n_tokens; ++i) {
        if (q.tokens[i] < 0 || q.tokens[i] >= res.n_vocab) {
            return "id " + std::to_string(q.tokens[i]) + " at index " + std::to_string(i) +
                   " is outside the vocabulary (0.." + std::to_string(res.n_vocab - 1) + ")";
        }
    }
    return "";
}

// REGION: this process's cache placed in the decoder's region (the per-request shared
// route's placement and params) and mapped in once, so no prefill pays first-touch faults.
int on_region(resident & res, kvshare_resident * r, const kvshare_resident_request & q) {
    const auto t0 = std::chrono::steady_clock::now();
    res.drop_region();
    llama_kvshare_kv_params kv = {};
    const int32_t rc = llama_kvshare_init_provider_handle(kvshare_resident_take_region(r), &kv, res.error,
                                                          sizeof res.error);
    if (rc != 0) {
        return reply_error(r, -rc, res.error);
    }
    llama_context_params cparams = llama_context_default_params();
    set_shared_params(cparams, kv);
    res.shared_ctx = res.make_context(cparams);
    if (res.shared_ctx == nullptr) {
        llama_kvshare_provider_finish();
        return reply_error(r, ENOMEM, "region " + std::to_string(q.region_id) + ": llama.cpp could not create a "
                                      "context of " + std::to_string(kv.n_ctx) + " cells");
    }
    if (!llama_kvshare_provider_placed(res.error, sizeof res.error)) {
        const std::string why = res.error;
        res.drop_region();
        return reply_error(r, EINVAL, "region " + std::to_string(q.region_id) + ": the KV cache could not be placed "
                                      "in the shared region: " + why);
    }
    res.shared_n_batch = cparams.n_batch;
    res.shared_streams = n_streams(kv);
    // every stream: each prefill may be for another slot's
    const int64_t prepared = llama_kvshare_provider_prepare(-1, 0, llama_n_ctx(res.shared_ctx));
    if (prepared < 0) {
        fprintf(stderr, "llama-kvshare-prefill: note: mapping in region %llu failed (%s); prefills fault its cells "
                        "in as they write\n", (unsigned long long) q.region_id, strerror((int) -prepared));
    }
    return kvshare_resident_reply_ok(r, ms_since(t0), 0);
}

// PREFILL_SHARED: the context's cells are made empty (metadata only: the bytes are the
// decoder's, and with them its cached prefix), cells 0..n_cached-1 of the request's stream
// marked as the decoder's prefix, ids n_cached.. decoded as the stream's sequence into cells
// n_cached.. of that stream.
int on_prefill_shared(resident & res, kvshare_resident * r, const kvshare_resident_request & q) {
    if (res.shared_ctx == nullptr) {
        return reply_error(r, ESTALE, "region " + std::to_string(q.region_id) + " has no context here; send it again");
    }
    const uint32_t stream = q.stream;
    if (stream >= res.shared_streams) {
        return reply_error(r, EINVAL, "stream " + std::to_string(stream) + ": the decoder's cache has " +
                                      std::to_string(res.shared_streams) + " stream(s)");
    }
    const std::string bad = check_ids(res, q, llama_n_ctx_seq(res.shared_ctx));
    if (!bad.empty()) {
        return reply_error(r, EINVAL, bad);
    }
    // a unified cache's run of cells (0, 0: none): id p at cell first_cell + p
    uint32_t first_cell = 0, n_cells = 0;
    kvshare_resident_cells(r, &first_cell, &n_cells);
    if (n_cells > 0 && (q.n_tokens > n_cells || q.n_cached > 0 ||
                        (uint64_t) first_cell + n_cells > llama_n_ctx_seq(res.shared_ctx))) {
        return reply_error(r, q.n_tokens > n_cells ? ERANGE : EINVAL,
                           "cells " + std::to_string(first_cell) + ".." + std::to_string(first_cell + n_cells - 1) +
                           ": " + std::to_string(q.n_tokens) + " tokens, n_cached " + std::to_string(q.n_cached) +
                           ", " + std::to_string(llama_n_ctx_seq(res.shared_ctx)) + " cells per stream");
    }
    llama_memory_clear(llama_get_memory(res.shared_ctx), false);
    llama_seq_id placeholder = -1;
    if (first_cell > 0) {
        const int32_t rc = llama_kvshare_provider_skip_cells(res.shared_ctx, (llama_seq_id) stream, first_cell,
                                                             &placeholder, res.error, sizeof res.error);
        if (rc != 0) {
            return reply_error(r, -rc, "first_cell " + std::to_string(first_cell) + ": " + res.error);
        }
    }
    if (q.n_cached > 0) {
        // -ENOTSUP for a memory that cannot resume from cells (iSWA, recurrent, hybrid)
        const int32_t rc = llama_kvshare_provider_cached(res.shared_ctx, (llama_seq_id) stream, q.tokens,
                                                         (int32_t) q.n_cached, res.error, sizeof res.error);
        if (rc != 0) {
            return reply_error(r, -rc, "n_cached " + std::to_string(q.n_cached) + ": " + res.error);
        }
    }
    const auto t0 = std::chrono::steady_clock::now();
    const std::string failed = decode_seq(res.shared_ctx, q.tokens, q.n_tokens, q.n_cached, res.shared_n_batch,
                                          (llama_seq_id) stream);
    if (placeholder >= 0) {
        llama_memory_seq_rm(llama_get_memory(res.shared_ctx), placeholder, -1, -1);
    }
    if (!failed.empty()) {
        return reply_error(r, EIO, failed);
    }
    return kvshare_resident_reply_ok(r, ms_since(t0), q.n_tokens - q.n_cached);
}

// PREFILL_FILE: a private context for the request's KV params (kept while they stay the
// same, its cells emptied per request), the ids decoded, the sequence saved in llama.cpp's
// own state-file version.
int on_prefill_file(resident & res, kvshare_resident * r, const kvshare_resident_request & q) {
    if (q.state_version != 0 && q.state_version != LLAMA_STATE_SEQ_VERSION) {
        return reply_error(r, ENOTSUP, "state file version " + std::to_string(q.state_version) + ": this llama.cpp "
                                       "writes version " + std::to_string(LLAMA_STATE_SEQ_VERSION) + " only");
    }
    const bool same = res.file_ctx != nullptr && res.file_kv.n_ctx == q.kv.n_ctx && res.file_kv.type_k == q.kv.type_k &&
                      res.file_kv.type_v == q.kv.type_v && res.file_kv.flash_attn == q.kv.flash_attn &&
                      res.file_kv.n_seq_max == q.kv.n_seq_max && res.file_kv.kv_unified == q.kv.kv_unified;
    if (!same) {
        if (res.file_ctx != nullptr) {
            llama_free(res.file_ctx);
        }
        llama_context_params cparams = llama_context_default_params();
        set_file_params(cparams, q.kv.n_ctx, (ggml_type) q.kv.type_k, (ggml_type) q.kv.type_v,
                        q.kv.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED,
                        q.kv.n_seq_max, q.kv.kv_unified != 0);
        res.file_ctx = res.make_context(cparams);
        res.file_kv = q.kv;
        if (res.file_ctx == nullptr) {
            return reply_error(r, ENOMEM, "llama.cpp could not create a context of " + std::to_string(q.kv.n_ctx) +
                                          " cells (" + ggml_type_name((ggml_type) q.kv.type_k) + " K, " +
                                          ggml_type_name((ggml_type) q.kv.type_v) + " V)");
        }
    }
    const std::string bad = check_ids(res, q, llama_n_ctx(res.file_ctx));
    if (!bad.empty()) {
        return reply_error(r, EINVAL, bad);
    }
    // private cells: no byte of an empty cell reaches the file (state_write saves the sequence's)
    llama_memory_clear(llama_get_memory(res.file_ctx), false);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string failed = decode_seq(res.file_ctx, q.tokens, q.n_tokens, 0, 512, 0);
    if (!failed.empty()) {
        return reply_error(r, EIO, failed);
    }
    // an iSWA model's file keeps n_swa + 1 SWA positions, so that llama-server reuses it
    llama_kvshare_keep_swa_boundary(true);
    if (llama_state_seq_save_file(res.file_ctx, q.state_file, 0, q.tokens, q.n_tokens) == 0) {
        return reply_error(r, EIO, std::string("writing the state file ") + q.state_file + " failed");
    }
    return kvshare_resident_reply_ok(r, ms_since(t0), q.n_tokens);
}

// --serve PATH: a signal ends the provider; its socket must not outlive it.
char g_socket_path[4096];
void remove_socket_and_exit(int) {
    unlink(g_socket_path);
    _exit(0);
}

int serve_main(const options & o) {
    if (!o.verbose) {
        llama_log_set(quiet_log, nullptr);
    }
    const bool listening = !o.serve.empty();
    kvshare_resident * r = nullptr;
    const int rc = listening ? kvshare_resident_listen(o.serve.c_str(), o.model.c_str(), &r)
                             : kvshare_resident_from_fd(atoi(o.serve_fd.c_str()), o.model.c_str(), &r);
    if (rc != 0) {
        fprintf(stderr, "llama-kvshare-prefill: %s\n", kvshare_resident_last_error(r));
        kvshare_resident_close(r);
        return 1;
    }
    if (listening) {
        snprintf(g_socket_path, sizeof g_socket_path, "%s", o.serve.c_str());
        signal(SIGTERM, remove_socket_and_exit);
        signal(SIGINT, remove_socket_and_exit);
    }
    llama_backend_init();
    int status = 0;
    {
        resident res;
        res.n_threads = o.n_threads;
        llama_model_params mparams = llama_model_default_params();
        mparams.n_gpu_layers = o.n_gpu_layers;
        res.model = llama_model_load_from_file(o.model.c_str(), mparams);
        if (res.model == nullptr) {
            fprintf(stderr, "llama-kvshare-prefill: model %s: llama.cpp could not load it\n", o.model.c_str());
            kvshare_resident_close(r);
            llama_backend_free();
            return 1;
        }
        res.n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(res.model));
        // the hello says the model is loaded: serve sends nothing before it
        if (kvshare_resident_hello(r, KVSHARE_ROUTE_SHARED | KVSHARE_ROUTE_FILE, 1) != 0) {
            fprintf(stderr, "llama-kvshare-prefill: %s\n", kvshare_resident_last_error(r));
            status = 1;
        }
        if (listening) {
            fprintf(stderr, "llama-kvshare-prefill: serving %s on %s\n", o.model.c_str(), o.serve.c_str());
        }
        kvshare_resident_request q = {};
        q.struct_size = sizeof q;
        for (;;) {
            if (kvshare_resident_next(r, -1, &q) != 0) {
                // the channel broke: END follows (a listener then waits for the next serve); a
                // listener that cannot accept does not spin
                fprintf(stderr, "llama-kvshare-prefill: %s\n", kvshare_resident_last_error(r));
                status = 1;
                if (listening) {
                    usleep(100 * 1000);
                }
                continue;
            }
            int replied = 0;
            switch (q.kind) {
                case KVSHARE_REQUEST_REGION:         replied = on_region(res, r, q); break;
                case KVSHARE_REQUEST_PREFILL_SHARED: replied = on_prefill_shared(res, r, q); break;
                case KVSHARE_REQUEST_PREFILL_FILE:   replied = on_prefill_file(res, r, q); break;
                default:                             break;
            }
            if (q.kind == KVSHARE_REQUEST_END) {
                res.drop_region();  // that serve's decoder region: released with its channel
                if (!listening) {
                    break;
                }
                status = 0;
                continue;
            }
            if (replied != 0) {
                fprintf(stderr, "llama-kvshare-prefill: %s\n", kvshare_resident_last_error(r));
            }
        }
        res.drop_region();
        if (res.file_ctx != nullptr) {
            llama_free(res.file_ctx);
            res.file_ctx = nullptr;
        }
        llama_model_free(res.model);
        res.model = nullptr;
    }
    kvshare_resident_close(r);
    llama_backend_free();
    return status;
}

} // namespace

int main(int argc, char ** argv) {
    options o;
    if (!parse_args(argc, argv, o)) {
        usage(argv[0]);
        return 2;
    }
    if (!o.serve_fd.empty() || !o.serve.empty()) {
        return serve_main(o);
    }
    std::vector<llama_token> ids;
    if (!read_ids(o.tokens, ids)) {
        return 1;
    }
    const size_t n_cached = o.cached.empty() ? 0 : (size_t) atol(o.cached.c_str());
    if (n_cached >= ids.size()) {
        fprintf(stderr, "llama-kvshare-prefill: --cached %zu: must be less than the %zu ids of %s (at least one id to prefill)\n",
                n_cached, ids.size(), o.tokens.c_str());
        usage(argv[0]);
        return 2;
    }
    // a unified cache's run of cells: id p at cell first_cell + p, at most n_cells ids
    const uint32_t first_cell = o.first_cell.empty() ? 0 : (uint32_t) atol(o.first_cell.c_str());
    const uint32_t n_cells = o.n_cells.empty() ? 0 : (uint32_t) atol(o.n_cells.c_str());
    if (n_cells > 0 && ids.size() > n_cells) {
        fprintf(stderr, "llama-kvshare-prefill: --cells %u: the %zu ids of %s do not fit the share's run of cells\n",
                n_cells, ids.size(), o.tokens.c_str());
        usage(argv[0]);
        return 2;
    }
    if (!o.verbose) {
        llama_log_set(quiet_log, nullptr);
    }
    llama_backend_init();

    llama_context_params cparams = llama_context_default_params();
    const bool shared = !o.layout.empty();
    // the stream the share is for, decoded as the sequence of that number (0 on the file route)
    const llama_seq_id seq = o.stream.empty() ? 0 : (llama_seq_id) atoi(o.stream.c_str());
    char error[2048] = "";
    if (shared) {
        // The header is the decoder's: its KV params are this context's, whatever flags say.
        llama_kvshare_kv_params kv = {};
        if (llama_kvshare_init_provider(o.model.c_str(), o.layout.c_str(), o.fds.c_str(), &kv, error, sizeof error) != 0) {
            fprintf(stderr, "llama-kvshare-prefill: %s\n", error);
            return 1;
        }
        if ((uint32_t) seq >= n_streams(kv)) {
            fprintf(stderr, "llama-kvshare-prefill: --stream %d: the decoder's cache in %s has %u stream(s)\n", seq,
                    o.layout.c_str(), n_streams(kv));
            llama_kvshare_provider_finish();
            return 2;
        }
        set_shared_params(cparams, kv);
    } else {
        ggml_type type_k, type_v;
        if (!cache_type(o.type_k, type_k) || !cache_type(o.type_v, type_v)) {
            return 2;
        }
        set_file_params(cparams, (uint32_t) o.n_ctx, type_k, type_v,
                        o.flash_attn == "on"  ? LLAMA_FLASH_ATTN_TYPE_ENABLED
                        : o.flash_attn == "off" ? LLAMA_FLASH_ATTN_TYPE_DISABLED
                                                : LLAMA_FLASH_ATTN_TYPE_AUTO,
                        (uint32_t) o.n_seq_max, o.kv_unified);
    }
    if (o.n_threads > 0) {
        cparams.n_threads = cparams.n_threads_batch = o.n_threads;
    }

    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = o.n_gpu_layers;
    llama_model * model = llama_model_load_from_file(o.model.c_str(), mparams);
    if (model == nullptr) {
        fprintf(stderr, "llama-kvshare-prefill: model %s: llama.cpp could not load it\n", o.model.c_str());
        return 1;
    }
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx == nullptr) {
        fprintf(stderr, "llama-kvshare-prefill: model %s: llama.cpp could not create a context\n", o.model.c_str());
        llama_model_free(model);
        return 1;
    }
    if (shared && !llama_kvshare_provider_placed(error, sizeof error)) {
        fprintf(stderr, "llama-kvshare-prefill: layout %s: the KV cache could not be placed in the shared region: %s\n",
                o.layout.c_str(), error);
        llama_free(ctx);
        llama_model_free(model);
        return 1;
    }
    if (n_cells > 0 && (uint64_t) first_cell + n_cells > llama_n_ctx_seq(ctx)) {
        fprintf(stderr, "llama-kvshare-prefill: --first-cell %u --cells %u: past the decoder's %u cells per stream\n",
                first_cell, n_cells, llama_n_ctx_seq(ctx));
        llama_free(ctx);
        llama_model_free(model);
        llama_kvshare_provider_finish();
        return 2;
    }
    if (ids.size() >= llama_n_ctx_seq(ctx)) {
        // a sequence's cells: one stream's of a cache with one per sequence
        fprintf(stderr, "llama-kvshare-prefill: ids file %s: %zu tokens do not fit a context of %u cells\n",
                o.tokens.c_str(), ids.size(), llama_n_ctx_seq(ctx));
        llama_free(ctx);
        llama_model_free(model);
        return 1;
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (size_t i = 0; i < ids.size(); ++i) {
        if (ids[i] >= n_vocab) {
            fprintf(stderr, "llama-kvshare-prefill: ids file %s: id %d at index %zu is outside the vocabulary (0..%d)\n",
                    o.tokens.c_str(), ids[i], i, n_vocab - 1);
            llama_free(ctx);
            llama_model_free(model);
            return 1;
        }
    }

    if (n_cached > 0) {
        // the decoder's cached prefix: this context's cells 0..P-1 become seq's positions
        // 0..P-1 (adopt's metadata step; no byte moves), so the decode below starts at P
        if (llama_kvshare_provider_cached(ctx, seq, ids.data(), (int32_t) n_cached, error, sizeof error) != 0) {
            fprintf(stderr, "llama-kvshare-prefill: --cached %zu: %s\n", n_cached, error);
            llama_free(ctx);
            llama_model_free(model);
            return 1;
        }
    }
    // a run of cells: cells 0..first_cell-1 taken by a placeholder sequence, so the decode
    // below puts positions 0.. at first_cell.. (the cells before are other slots')
    llama_seq_id placeholder = -1;
    if (first_cell > 0 &&
        llama_kvshare_provider_skip_cells(ctx, seq, first_cell, &placeholder, error, sizeof error) != 0) {
        fprintf(stderr, "llama-kvshare-prefill: --first-cell %u: %s\n", first_cell, error);
        llama_free(ctx);
        llama_model_free(model);
        llama_kvshare_provider_finish();
        return 1;
    }
    int64_t prepared = 0;
    if (shared) {
        // The prefill writes the decoder's cells through this process's fresh mapping: map
        // them in first, one madvise per tensor, instead of one fault per 4 KiB page. As the
        // file route's clearing of its private cache, this happens before prefill_ms starts.
        prepared = llama_kvshare_provider_prepare(seq, first_cell + (uint32_t) n_cached, first_cell + (uint32_t) ids.size());
        if (prepared < 0) {
            fprintf(stderr, "llama-kvshare-prefill: note: mapping in the shared cells failed (%s); the prefill "
                            "faults them in as it writes\n", strerror((int) -prepared));
        }
    }
    const auto t0 = std::chrono::steady_clock::now();
    const std::string failed = decode_seq(ctx, ids.data(), ids.size(), n_cached, cparams.n_batch, seq);
    if (placeholder >= 0) {
        llama_memory_seq_rm(llama_get_memory(ctx), placeholder, -1, -1);
    }
    int rc = failed.empty() ? 0 : 1;
    if (rc != 0) {
        fprintf(stderr, "llama-kvshare-prefill: %s\n", failed.c_str());
    }
    if (rc == 0 && !shared) {
        // An iSWA model's file keeps n_swa + 1 SWA positions, so that llama-server reuses it
        // (llama-kvshare.h); a model without SWA layers is unaffected.
        llama_kvshare_keep_swa_boundary(true);
        if (llama_state_seq_save_file(ctx, o.out.c_str(), 0, ids.data(), ids.size()) == 0) {
            fprintf(stderr, "llama-kvshare-prefill: writing the state file %s failed\n", o.out.c_str());
            rc = 1;
        }
    }
    const double prefill_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    llama_free(ctx);
    llama_model_free(model);
    if (shared) {
        llama_kvshare_provider_finish(); // the decoder may adopt once this process has exited
    }
    llama_backend_free();
    if (rc != 0) {
        return 1;
    }
    // the decoder's cached prefix, when there was one, after the sentence of a whole prefill
    char cached_note[96] = "";
    if (n_cached > 0) {
        snprintf(cached_note, sizeof cached_note, ", the first %zu already in the decoder's cells", n_cached);
    }
    if (shared && prepared > 0) {
        fprintf(stderr, "llama-kvshare-prefill: shared route, %zu tokens, %.1f MiB of the decoder's cells mapped in "
                        "before the prefill%s\n", ids.size(), (double) prepared / (1 << 20), cached_note);
    } else {
        fprintf(stderr, "llama-kvshare-prefill: %s route, %zu tokens%s\n", shared ? "shared" : "file", ids.size(), cached_note);
    }
    printf("{\"prefill_ms\": %.3f, \"n_prefilled\": %zu}\n", prefill_ms, ids.size() - n_cached);
    return 0;
}
