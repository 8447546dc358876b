/* The C API as a C11 consumer sees it: only kvshare.h, only kvshare_ symbols.
 * One binary; `capi_tests NAME` runs one test (ctest registers each name), and every
 * test checks that the process ends with the descriptors it started with.
 * Usage: capi_tests NAME MKMODEL_PATH WORK_DIR */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "kvshare.h"

static int failures;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            ++failures;                                                              \
        }                                                                            \
    } while (0)

#define CHECK_RC(expr, expected)                                                                              \
    do {                                                                                                      \
        int rc_ = (expr);                                                                                     \
        if (rc_ != (expected)) {                                                                              \
            fprintf(stderr, "%s:%d: %s returned %d (%s), expected %d (%s)\n", __FILE__, __LINE__, #expr, rc_, \
                    strerror(-rc_), (expected), strerror(-(expected)));                                       \
            ++failures;                                                                                       \
        }                                                                                                     \
    } while (0)

#define CHECK_CONTAINS(text, word)                                                                             \
    do {                                                                                                       \
        const char *t_ = (text);                                                                               \
        if (t_ == NULL || strstr(t_, (word)) == NULL) {                                                        \
            fprintf(stderr, "%s:%d: \"%s\" does not contain \"%s\"\n", __FILE__, __LINE__, t_ ? t_ : "(null)", \
                    (word));                                                                                   \
            ++failures;                                                                                        \
        }                                                                                                      \
    } while (0)

static const char *mkmodel;
static const char *models_dir; /* shared by the tests: models are made once */
static const char *work_dir;   /* this test's own 0700 directory, short enough for sun_path */

static int count_open_fds(void) {
    DIR *dir = opendir("/proc/self/fd");
    if (dir == NULL) return -1;
    int n = 0;
    for (struct dirent *e = readdir(dir); e != NULL; e = readdir(dir))
        if (e->d_name[0] != '.') ++n;
    closedir(dir);
    return n - 1; /* the directory's own descriptor */
}

/* A model kvshare-mkmodel writes into the models dir (cached across tests). */
static const char *model_path(const char *arch, int seed) {
    static char path[4][4096];
    static int next;
    char *out = path[next++ % 4];
    snprintf(out, sizeof path[0], "%s/capi-%s-%d.gguf", models_dir, arch, seed);
    if (access(out, R_OK) != 0) {
        char command[8192];
        snprintf(command, sizeof command, "'%s' --arch %s --seed %d '%s' >/dev/null", mkmodel, arch, seed, out);
        if (system(command) != 0) {
            fprintf(stderr, "could not make a model: %s\n", command);
            exit(1);
        }
    }
    return out;
}

static struct kvshare_kv_params small_params(void) {
    struct kvshare_kv_params params;
    kvshare_kv_params_init(&params);
    params.n_ctx = 256;
    return params;
}

/* A broker's listening socket in the work dir. */
static int listen_at(const char *name, char *path_out, size_t path_size) {
    snprintf(path_out, path_size, "%s/%s", work_dir, name);
    unlink(path_out);
    struct sockaddr_un addr;
    if (strlen(path_out) >= sizeof addr.sun_path) {
        /* Truncating it would bind one path while the decoder connects to another. */
        fprintf(stderr, "socket path %s is %zu bytes, the limit is %zu: set TMPDIR shorter\n", path_out,
                strlen(path_out), sizeof addr.sun_path - 1);
        exit(1);
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    strncpy(addr.sun_path, path_out, sizeof addr.sun_path - 1);
    if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(fd, 4) != 0) {
        perror("listen");
        exit(1);
    }
    return fd;
}

/* Receives one handshake frame: the JSON (NUL-terminated, malloc'd) and its fds. */
static char *receive_share(int listener, int *fds, int max_fds, int *n_fds) {
    int conn = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
    CHECK(conn >= 0);
    size_t capacity = 1 << 20, got = 0;
    char *buf = malloc(capacity + 1);
    char control[CMSG_SPACE(sizeof(int) * 16)];
    *n_fds = 0;
    for (;;) {
        struct iovec iov = {buf + got, capacity - got};
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
        ssize_t n = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC);
        if (n <= 0) break;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
                int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
                for (int i = 0; i < count && *n_fds < max_fds; ++i)
                    memcpy(&fds[(*n_fds)++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            }
        }
        got += (size_t)n;
        if (got >= 4) {
            uint32_t length = (uint32_t)(unsigned char)buf[0] | (uint32_t)(unsigned char)buf[1] << 8 |
                              (uint32_t)(unsigned char)buf[2] << 16 | (uint32_t)(unsigned char)buf[3] << 24;
            if (got >= 4 + (size_t)length) break;
        }
    }
    close(conn);
    buf[got] = '\0';
    memmove(buf, buf + 4, got >= 4 ? got - 3 : 1);
    return buf;
}

/* The message ends with ,"header":{...}} (docs/protocol.md): write that object to a file,
 * as the broker writes the --layout file. */
static void write_layout_file(const char *message, const char *path) {
    const char *header = strstr(message, "\"header\":");
    CHECK(header != NULL);
    if (header == NULL) return;
    header += strlen("\"header\":");
    FILE *f = fopen(path, "w");
    fwrite(header, 1, strlen(header) - 1, f); /* drop the envelope's closing brace */
    fclose(f);
}

static uint16_t f16_bits(float value) {
    /* Exact for the small integers these tests use. */
    union {
        float f;
        uint32_t u;
    } v = {value};
    uint32_t sign = (v.u >> 16) & 0x8000u;
    int exp = (int)((v.u >> 23) & 0xff) - 127 + 15;
    uint32_t mant = (v.u >> 13) & 0x3ffu;
    if ((v.u & 0x7fffffffu) == 0) return (uint16_t)sign;
    return (uint16_t)(sign | (uint32_t)exp << 10 | mant);
}

/* ---- tests ---- */

static void decoder_places_every_cache_tensor_in_its_exported_chunks(void) {
    struct kvshare_kv_params params = small_params();
    struct kvshare_decoder *d = NULL;
    CHECK_RC(kvshare_decoder_open(model_path("llama", 3), &params, &d), 0);
    CHECK(d != NULL);
    CHECK(kvshare_decoder_can_share(d) == 1);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "");
    CHECK(strcmp(kvshare_decoder_refusal(d), "") == 0);
    CHECK(kvshare_decoder_n_chunks(d) >= 1);
    CHECK(kvshare_decoder_n_tensors(d) >= 2);
    uint64_t total = 0;
    for (uint32_t i = 0; i < kvshare_decoder_n_chunks(d); ++i) {
        void *base = NULL;
        uint64_t size = 0;
        CHECK_RC(kvshare_decoder_chunk(d, i, &base, &size), 0);
        CHECK(base != NULL && size % 4096 == 0);
        total += size;
    }
    CHECK(total == kvshare_decoder_region_bytes(d));
    CHECK_RC(kvshare_decoder_chunk(d, kvshare_decoder_n_chunks(d), NULL, NULL), -ERANGE);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "chunk");

    struct kvshare_tensor_info k = {.struct_size = sizeof k};
    CHECK_RC(kvshare_decoder_tensor(d, "cache_k_l0", &k), 0);
    void *base = NULL;
    kvshare_decoder_chunk(d, k.chunk, &base, NULL);
    CHECK(k.offset % 4096 == 0);
    CHECK((char *)k.data == (char *)base + k.offset);
    CHECK(k.ne[1] == 256); /* kv_size */
    CHECK(k.type == 1);    /* GGML_TYPE_F16 */
    CHECK(k.layer == 0);
    CHECK(k.row_bytes == (uint64_t)k.ne[0] * 2);
    struct kvshare_tensor_info none = {.struct_size = sizeof none};
    CHECK_RC(kvshare_decoder_tensor(d, "cache_k_l999", &none), -ENOENT);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "cache_k_l999");
    struct kvshare_tensor_info old = {.struct_size = 8};
    CHECK_RC(kvshare_decoder_tensor(d, "cache_k_l0", &old), -EINVAL);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "struct_size");
    CHECK(strcmp(kvshare_decoder_backend(d), "") != 0);
    kvshare_decoder_close(d);
}

static void share_sends_one_fd_per_chunk_mapping_the_decoders_cache(void) {
    struct kvshare_kv_params params = small_params();
    struct kvshare_decoder *d = NULL;
    CHECK_RC(kvshare_decoder_open(model_path("llama", 3), &params, &d), 0);
    char socket_path[4096];
    int listener = listen_at("capi-share.sock", socket_path, sizeof socket_path);
    uint64_t share_id = 0;
    CHECK_RC(kvshare_decoder_share(d, socket_path, 2000, &share_id), 0);
    CHECK(share_id == 1);
    int fds[16], n_fds = 0;
    char *message = receive_share(listener, fds, 16, &n_fds);
    CHECK(n_fds == (int)kvshare_decoder_n_chunks(d));
    CHECK_CONTAINS(message, "\"share_id\":1");
    CHECK_CONTAINS(message, "cache_v_l0");

    /* A byte the decoder writes through its mapping is the byte the peer's fd maps. */
    struct kvshare_tensor_info v = {.struct_size = sizeof v};
    CHECK_RC(kvshare_decoder_tensor(d, "cache_v_l0", &v), 0);
    void *chunk_base = NULL;
    uint64_t chunk_size = 0;
    kvshare_decoder_chunk(d, v.chunk, &chunk_base, &chunk_size);
    ((unsigned char *)v.data)[5] = 0xa7;
    unsigned char *peer = mmap(NULL, chunk_size, PROT_READ, MAP_SHARED, fds[v.chunk], 0);
    CHECK(peer != MAP_FAILED);
    if (peer != MAP_FAILED) {
        CHECK(peer[v.offset + 5] == 0xa7);
        munmap(peer, chunk_size);
    }
    for (int i = 0; i < n_fds; ++i) close(fds[i]);
    free(message);
    close(listener);
    unlink(socket_path);
    kvshare_decoder_close(d);
}

static void adopt_takes_only_the_latest_sent_share_once(void) {
    struct kvshare_kv_params params = small_params();
    struct kvshare_decoder *d = NULL;
    CHECK_RC(kvshare_decoder_open(model_path("llama", 3), &params, &d), 0);
    CHECK_RC(kvshare_decoder_adopt(d, 4, 1), -ESTALE);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "no share has been made");

    char socket_path[4096];
    int listener = listen_at("capi-adopt.sock", socket_path, sizeof socket_path);
    uint64_t first = 0, second = 0;
    int fds[16], n_fds = 0;
    CHECK_RC(kvshare_decoder_share(d, socket_path, 2000, &first), 0);
    free(receive_share(listener, fds, 16, &n_fds));
    for (int i = 0; i < n_fds; ++i) close(fds[i]);
    CHECK_RC(kvshare_decoder_share(d, socket_path, 2000, &second), 0);
    free(receive_share(listener, fds, 16, &n_fds));
    for (int i = 0; i < n_fds; ++i) close(fds[i]);
    CHECK(second == first + 1);

    CHECK_RC(kvshare_decoder_adopt(d, 4, first), -ESTALE);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "it is stale, the later share");
    CHECK_RC(kvshare_decoder_adopt(d, 0, second), -EINVAL);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "0 tokens");
    CHECK_RC(kvshare_decoder_adopt(d, 257, second), -ERANGE);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "257 tokens");
    CHECK_RC(kvshare_decoder_adopt(d, 4, second), 0);
    CHECK_RC(kvshare_decoder_adopt(d, 4, second), -ESTALE);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "already adopted");

    /* A share that never reached a broker spends its id: nothing to adopt. */
    char missing[4096];
    snprintf(missing, sizeof missing, "%s/capi-nobody-listens.sock", work_dir);
    unlink(missing);
    uint64_t lost = 0;
    int rc = kvshare_decoder_share(d, missing, 500, &lost);
    CHECK(rc == -ENOENT || rc == -ECONNREFUSED);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "capi-nobody-listens.sock");
    CHECK_RC(kvshare_decoder_adopt(d, 4, second + 1), -ESTALE);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "never reached a broker");
    close(listener);
    unlink(socket_path);
    kvshare_decoder_close(d);
}

static void a_decoder_that_cannot_share_names_both_causes(void) {
    CHECK_CONTAINS(kvshare_decoder_refusal(NULL), "ONEBIT_KV_SHARE was not set");
    CHECK_CONTAINS(kvshare_decoder_refusal(NULL), "KV backend");

    struct kvshare_kv_params params = small_params();
    struct kvshare_decoder *d = NULL;
    char missing[4096];
    snprintf(missing, sizeof missing, "%s/no-such-model.gguf", work_dir);
    CHECK_RC(kvshare_decoder_open(missing, &params, &d), -ENOENT);
    CHECK(d != NULL);
    CHECK(kvshare_decoder_can_share(d) == 0);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "no-such-model.gguf");
    CHECK_CONTAINS(kvshare_decoder_refusal(d), "ONEBIT_KV_SHARE is set");
    CHECK_CONTAINS(kvshare_decoder_refusal(d), "no-such-model.gguf");
    uint64_t id = 0;
    CHECK_RC(kvshare_decoder_share(d, "/nonexistent.sock", 100, &id), -ENOTSUP);
    CHECK_RC(kvshare_decoder_adopt(d, 1, 1), -ENOTSUP);
    CHECK(kvshare_decoder_n_chunks(d) == 0);
    kvshare_decoder_close(d);

    /* Bad params are refused by name. */
    params.type_k = 4; /* removed from ggml */
    CHECK_RC(kvshare_decoder_open(model_path("llama", 3), &params, &d), -EINVAL);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "type_k 4");
    kvshare_decoder_close(d);
}

static void decline_releases_the_regions_and_refuses_with_the_reason(void) {
    struct kvshare_kv_params params = small_params();
    struct kvshare_decoder *d = NULL;
    const int before = count_open_fds();
    CHECK_RC(kvshare_decoder_open(model_path("llama", 3), &params, &d), 0);
    CHECK(count_open_fds() > before);
    kvshare_decoder_decline(d, "cache_k_l1 is q8_0 here, the layout says f16");
    CHECK(count_open_fds() == before);
    CHECK(kvshare_decoder_can_share(d) == 0);
    CHECK_CONTAINS(kvshare_decoder_refusal(d), "cache_k_l1 is q8_0 here");
    uint64_t id = 0;
    CHECK_RC(kvshare_decoder_share(d, "/nonexistent.sock", 100, &id), -ENOTSUP);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "cache_k_l1 is q8_0 here");
    kvshare_decoder_close(d);
}

/* The provider end to end: imports the fds a share sent, scatters f32 rows, and the
 * decoder's own mapping holds them as f16 at the cells written. */
static void provider_scatter_lands_in_the_decoders_cells(void) {
    struct kvshare_kv_params params = small_params();
    struct kvshare_decoder *d = NULL;
    const char *model = model_path("llama", 3);
    CHECK_RC(kvshare_decoder_open(model, &params, &d), 0);
    char socket_path[4096], layout_path[4096], fd_list[256] = "";
    int listener = listen_at("capi-provider.sock", socket_path, sizeof socket_path);
    uint64_t share_id = 0;
    CHECK_RC(kvshare_decoder_share(d, socket_path, 2000, &share_id), 0);
    int fds[16], n_fds = 0;
    char *message = receive_share(listener, fds, 16, &n_fds);
    snprintf(layout_path, sizeof layout_path, "%s/capi-layout.json", work_dir);
    write_layout_file(message, layout_path);
    for (int i = 0; i < n_fds; ++i)
        snprintf(fd_list + strlen(fd_list), sizeof fd_list - strlen(fd_list), "%s%d", i ? "," : "", fds[i]);

    struct kvshare_provider *p = NULL;
    CHECK_RC(kvshare_provider_open(layout_path, fd_list, model, &p), 0);
    if (failures == 0) {
        struct kvshare_kv_params theirs;
        CHECK_RC(kvshare_provider_kv_params(p, &theirs), 0);
        CHECK(theirs.n_ctx == 256 && theirs.type_k == 1 && theirs.flash_attn == 1);
        CHECK(kvshare_provider_kv_size(p) == 256);
        CHECK(kvshare_provider_n_chunks(p) == kvshare_decoder_n_chunks(d));
        struct kvshare_tensor_info k = {.struct_size = sizeof k}, v = {.struct_size = sizeof v};
        CHECK_RC(kvshare_provider_tensor(p, "cache_k_l0", &k), 0);
        CHECK_RC(kvshare_provider_tensor(p, "cache_v_l0", &v), 0);
        const uint32_t n_k = (uint32_t)k.ne[0], n_v = (uint32_t)v.ne[0], n_tokens = 3;
        float *rows = calloc((size_t)n_tokens * (n_k + n_v), sizeof(float));
        for (uint32_t t = 0; t < n_tokens; ++t)
            for (uint32_t j = 0; j < n_k + n_v; ++j)
                rows[t * (n_k + n_v) + j] = (float)(t + 1) * (j < n_k ? 1.0f : -1.0f);
        CHECK_RC(kvshare_provider_begin_write(p), 0);
        CHECK_RC(kvshare_provider_scatter(p, 0, 5, n_tokens, 0 /* F32 */, rows, (n_k + n_v) * sizeof(float), n_k, n_v),
                 0);
        CHECK_RC(kvshare_provider_end_write(p), 0);
        /* A width the cache does not have is refused before anything is written. */
        CHECK_RC(kvshare_provider_scatter(p, 0, 0, 1, 0, rows, (n_k + n_v) * sizeof(float), n_k + 1, n_v), -EINVAL);
        CHECK_CONTAINS(kvshare_provider_last_error(p), "layer 0");
        CHECK_RC(kvshare_provider_scatter(p, 0, 255, 2, 0, rows, (n_k + n_v) * sizeof(float), n_k, n_v), -EINVAL);
        free(rows);

        struct kvshare_tensor_info dk = {.struct_size = sizeof dk}, dv = {.struct_size = sizeof dv};
        kvshare_decoder_tensor(d, "cache_k_l0", &dk);
        kvshare_decoder_tensor(d, "cache_v_l0", &dv);
        const uint16_t *k_cells = dk.data, *v_cells = dv.data;
        CHECK(k_cells[5 * n_k] == f16_bits(1.0f));
        CHECK(k_cells[7 * n_k + n_k - 1] == f16_bits(3.0f));
        CHECK(v_cells[6 * n_v] == f16_bits(-2.0f));
        CHECK(k_cells[4 * n_k] == 0 && k_cells[8 * n_k] == 0); /* neighbours untouched */

        /* KVSHARE_1.1, the NPU import: no device address before it, and no NPU on a machine
           without one (the stand-in driver tests of xdna/npu_share cover the import itself). */
        uint64_t address = 1;
        CHECK_RC(kvshare_provider_device_address(p, "cache_k_l0", &address), -ENXIO);
        CHECK_CONTAINS(kvshare_provider_last_error(p), "kvshare_provider_import_npu");
        CHECK_RC(kvshare_provider_device_address(p, "cache_k_l99", &address), -ENOENT);
        CHECK_CONTAINS(kvshare_provider_last_error(p), "cache_k_l99");
        char accel_dir[4200];
        snprintf(accel_dir, sizeof accel_dir, "%s/accel-none", work_dir);
        CHECK_RC(kvshare_provider_import_npu(p, accel_dir), -ENOENT);
        CHECK_CONTAINS(kvshare_provider_last_error(p), "accel-none");
        CHECK(mkdir(accel_dir, 0700) == 0);
        CHECK_RC(kvshare_provider_import_npu(p, accel_dir), -ENODEV);
        CHECK_CONTAINS(kvshare_provider_last_error(p), "no accel<N> node in");
        CHECK(address == 1); /* untouched by every failure */
        rmdir(accel_dir);

        /* KVSHARE_1.2 on a plain KV cache: there is no recurrent state to write. */
        CHECK(kvshare_provider_rs_size(p) == 0);
        uint64_t n_values = 5;
        CHECK_RC(kvshare_provider_state_width(p, 0, KVSHARE_STATE_R, &n_values), -ENOENT);
        CHECK_CONTAINS(kvshare_provider_last_error(p), "has no recurrent state");
        CHECK(n_values == 5);
    } else {
        fprintf(stderr, "provider open: %s\n", kvshare_provider_last_error(p));
    }
    const int before_close = count_open_fds();
    kvshare_provider_close(p);
    CHECK(count_open_fds() == before_close - n_fds); /* the provider owned the fds */
    CHECK_RC(kvshare_decoder_adopt(d, 8, share_id), 0);
    free(message);
    close(listener);
    unlink(socket_path);
    unlink(layout_path);
    kvshare_decoder_close(d);
}

static void provider_refuses_another_models_layout_and_bad_fds(void) {
    struct kvshare_kv_params params = small_params();
    struct kvshare_decoder *d = NULL;
    CHECK_RC(kvshare_decoder_open(model_path("llama", 3), &params, &d), 0);
    char socket_path[4096], layout_path[4096], fd_list[64];
    int listener = listen_at("capi-refuse.sock", socket_path, sizeof socket_path);
    uint64_t share_id = 0;
    CHECK_RC(kvshare_decoder_share(d, socket_path, 2000, &share_id), 0);
    int fds[16], n_fds = 0;
    char *message = receive_share(listener, fds, 16, &n_fds);
    snprintf(layout_path, sizeof layout_path, "%s/capi-refuse.json", work_dir);
    write_layout_file(message, layout_path);
    snprintf(fd_list, sizeof fd_list, "%d", fds[0]);

    struct kvshare_provider *p = NULL;
    CHECK_RC(kvshare_provider_open(layout_path, fd_list, model_path("qwen2", 4), &p), -EINVAL);
    CHECK(p == NULL);
    CHECK_CONTAINS(kvshare_provider_last_error(p), "model.");
    kvshare_provider_close(p);

    CHECK_RC(kvshare_provider_open(layout_path, "1", model_path("llama", 3), &p), -EINVAL);
    CHECK_CONTAINS(kvshare_provider_last_error(p), "--fds");
    kvshare_provider_close(p);
    CHECK_RC(kvshare_provider_open(layout_path, "999", NULL, &p), -EBADF);
    CHECK_CONTAINS(kvshare_provider_last_error(p), "999");
    kvshare_provider_close(p);

    for (int i = 0; i < n_fds; ++i) close(fds[i]);
    free(message);
    close(listener);
    unlink(socket_path);
    unlink(layout_path);
    kvshare_decoder_close(d);
}

/* A decoder with a share sent to a broker and a provider that imported it: what the
 * provider-side tests of KVSHARE_1.2 start from. */
struct handoff {
    struct kvshare_decoder *d;
    struct kvshare_provider *p;
    uint64_t share_id;
    int listener;
    int n_fds;
    char socket_path[4096];
    char layout_path[4096];
};

static int open_handoff(const char *model, const char *name, struct handoff *h) {
    struct kvshare_kv_params params = small_params();
    char socket_name[128], fd_list[256] = "";
    int fds[16];
    memset(h, 0, sizeof *h);
    CHECK_RC(kvshare_decoder_open(model, &params, &h->d), 0);
    snprintf(socket_name, sizeof socket_name, "%s.sock", name);
    h->listener = listen_at(socket_name, h->socket_path, sizeof h->socket_path);
    CHECK_RC(kvshare_decoder_share(h->d, h->socket_path, 2000, &h->share_id), 0);
    char *message = receive_share(h->listener, fds, 16, &h->n_fds);
    snprintf(h->layout_path, sizeof h->layout_path, "%s/%s.json", work_dir, name);
    write_layout_file(message, h->layout_path);
    free(message);
    for (int i = 0; i < h->n_fds; ++i)
        snprintf(fd_list + strlen(fd_list), sizeof fd_list - strlen(fd_list), "%s%d", i ? "," : "", fds[i]);
    const int rc = kvshare_provider_open(h->layout_path, fd_list, model, &h->p);
    CHECK_RC(rc, 0);
    if (rc != 0) fprintf(stderr, "provider open: %s\n", kvshare_provider_last_error(h->p));
    return rc == 0 && failures == 0;
}

static void close_handoff(struct handoff *h) {
    kvshare_provider_close(h->p);
    close(h->listener);
    unlink(h->socket_path);
    unlink(h->layout_path);
    kvshare_decoder_close(h->d);
}

/* KVSHARE_1.2 on qwen35 (Gated DeltaNet layers 0-2, attention layer 3): the widths, every
 * refusal, and the rows landing in the decoder's cache_r_l0 / cache_s_l0. */
static void provider_writes_recurrent_state_rows_into_the_decoders_region(void) {
    struct handoff h;
    if (!open_handoff(model_path("qwen35", 5), "capi-state", &h)) {
        close_handoff(&h);
        return;
    }
    struct kvshare_provider *p = h.p;
    CHECK(kvshare_provider_rs_size(p) == 1);
    CHECK(kvshare_provider_kv_size(p) == 256); /* the hybrid's attention cache */

    uint64_t n_r = 0, n_s = 0, untouched = 77;
    CHECK_RC(kvshare_provider_state_width(p, 0, KVSHARE_STATE_R, &n_r), 0);
    CHECK_RC(kvshare_provider_state_width(p, 0, KVSHARE_STATE_S, &n_s), 0);
    struct kvshare_tensor_info r = {.struct_size = sizeof r}, s = {.struct_size = sizeof s};
    CHECK_RC(kvshare_provider_tensor(p, "cache_r_l0", &r), 0);
    CHECK_RC(kvshare_provider_tensor(p, "cache_s_l0", &s), 0);
    CHECK(n_r > 0 && n_r == (uint64_t)r.ne[0] && r.ne[1] == 1 && r.type == 0 /* F32 */);
    CHECK(n_s > 0 && n_s == (uint64_t)s.ne[0]);
    CHECK_RC(kvshare_provider_state_width(p, 3, KVSHARE_STATE_R, &untouched), -ENOENT);
    CHECK_CONTAINS(kvshare_provider_last_error(p), "layer 3 has no cache_r_l3");
    CHECK_RC(kvshare_provider_state_width(p, 0, 7, &untouched), -EINVAL);
    CHECK_CONTAINS(kvshare_provider_last_error(p), "state kind 7");
    CHECK_RC(kvshare_provider_state_width(p, 0, KVSHARE_STATE_R, NULL), -EINVAL);
    CHECK(untouched == 77);

    float *r_row = malloc(n_r * sizeof(float)), *s_row = malloc(n_s * sizeof(float));
    for (uint64_t i = 0; i < n_r; ++i) r_row[i] = (float)i + 0.25f;
    for (uint64_t i = 0; i < n_s; ++i) s_row[i] = -(float)i;
    CHECK_RC(kvshare_provider_write_state(p, 0, KVSHARE_STATE_R, 0, r_row, n_r), -EINVAL);
    CHECK_CONTAINS(kvshare_provider_last_error(p), "kvshare_provider_begin_write");
    CHECK_RC(kvshare_provider_begin_write(p), 0);
    CHECK_RC(kvshare_provider_write_state(p, 0, KVSHARE_STATE_R, 0, r_row, n_r), 0);
    CHECK_RC(kvshare_provider_write_state(p, 0, KVSHARE_STATE_S, 0, s_row, n_s), 0);
    /* Refused before anything is written, each naming what is wrong. */
    CHECK_RC(kvshare_provider_write_state(p, 1, KVSHARE_STATE_R, 1, r_row, n_r), -ERANGE);
    CHECK_CONTAINS(kvshare_provider_last_error(p), "layer 1 cache_r_l1: cell 1 is past rs_size 1");
    CHECK_RC(kvshare_provider_write_state(p, 1, KVSHARE_STATE_S, 0, s_row, n_s - 1), -EINVAL);
    CHECK_CONTAINS(kvshare_provider_last_error(p), "cache_s_l1 cell 0");
    char widths[128];
    snprintf(widths, sizeof widths, "carries %llu values, the tensor's row holds %llu", (unsigned long long)(n_s - 1),
             (unsigned long long)n_s);
    CHECK_CONTAINS(kvshare_provider_last_error(p), widths);
    CHECK_RC(kvshare_provider_write_state(p, 3, KVSHARE_STATE_R, 0, r_row, n_r), -EINVAL);
    CHECK_CONTAINS(kvshare_provider_last_error(p), "layer 3 has no cache_r_l3");
    CHECK_RC(kvshare_provider_write_state(p, 1, 0, 0, r_row, n_r), -EINVAL);
    CHECK_CONTAINS(kvshare_provider_last_error(p), "KVSHARE_STATE_R");
    CHECK_RC(kvshare_provider_write_state(p, 1, KVSHARE_STATE_R, 0, NULL, n_r), -EINVAL);
    CHECK_CONTAINS(kvshare_provider_last_error(p), "NULL");
    CHECK_RC(kvshare_provider_end_write(p), 0);
    CHECK_RC(kvshare_provider_write_state(p, 1, KVSHARE_STATE_R, 0, r_row, n_r), -EINVAL);
    CHECK_CONTAINS(kvshare_provider_last_error(p), "not inside a write bracket");

    /* The decoder's own mapping holds the rows; layer 1's stayed as exported (zeros). */
    struct kvshare_tensor_info dr = {.struct_size = sizeof dr}, ds = {.struct_size = sizeof ds},
                               dr1 = {.struct_size = sizeof dr1};
    CHECK_RC(kvshare_decoder_tensor(h.d, "cache_r_l0", &dr), 0);
    CHECK_RC(kvshare_decoder_tensor(h.d, "cache_s_l0", &ds), 0);
    CHECK_RC(kvshare_decoder_tensor(h.d, "cache_r_l1", &dr1), 0);
    CHECK(memcmp(dr.data, r_row, n_r * sizeof(float)) == 0);
    CHECK(memcmp(ds.data, s_row, n_s * sizeof(float)) == 0);
    const float *r1 = dr1.data;
    int r1_zero = 1;
    for (uint64_t i = 0; i < n_r; ++i) r1_zero &= r1[i] == 0.0f;
    CHECK(r1_zero);
    free(r_row);
    free(s_row);

    /* The NPU address of a state tensor is asked by name like any other's. */
    uint64_t address = 1;
    CHECK_RC(kvshare_provider_device_address(p, "cache_r_l0", &address), -ENXIO);
    CHECK_RC(kvshare_provider_device_address(p, "cache_r_l3", &address), -ENOENT);
    CHECK(address == 1);
    CHECK_RC(kvshare_decoder_adopt(h.d, 8, h.share_id), 0);
    close_handoff(&h);
}

/* KVSHARE_1.2 on lfm2, whose conv layers hold no S: a 0-wide row is written as nothing. */
static void provider_state_of_lfm2_has_a_zero_wide_s(void) {
    struct handoff h;
    if (!open_handoff(model_path("lfm2", 6), "capi-lfm2", &h)) {
        close_handoff(&h);
        return;
    }
    uint64_t n_r = 0, n_s = 99;
    CHECK_RC(kvshare_provider_state_width(h.p, 0, KVSHARE_STATE_R, &n_r), 0);
    CHECK_RC(kvshare_provider_state_width(h.p, 0, KVSHARE_STATE_S, &n_s), 0);
    CHECK(n_r > 0 && n_s == 0);
    CHECK_RC(kvshare_provider_begin_write(h.p), 0);
    CHECK_RC(kvshare_provider_write_state(h.p, 0, KVSHARE_STATE_S, 0, NULL, 0), 0);
    float one = 1.0f;
    CHECK_RC(kvshare_provider_write_state(h.p, 0, KVSHARE_STATE_S, 0, &one, 1), -EINVAL);
    CHECK_CONTAINS(kvshare_provider_last_error(h.p), "holds 0 (n_embd_s)");
    CHECK_RC(kvshare_provider_end_write(h.p), 0);
    close_handoff(&h);
}

/* ---- KVSHARE_1.3: the resident provider; the test plays kvshare-serve ---- */

/* One frame of the resident protocol: a u32 little-endian length, the JSON, and any fds
 * (SCM_RIGHTS on the first byte), as kvshare-serve sends it. */
static void serve_send(int sock, const char *json, const int *fds, int n_fds) {
    size_t n = strlen(json);
    unsigned char *frame = malloc(n + 4);
    frame[0] = (unsigned char)n;
    frame[1] = (unsigned char)(n >> 8);
    frame[2] = (unsigned char)(n >> 16);
    frame[3] = (unsigned char)(n >> 24);
    memcpy(frame + 4, json, n);
    char control[CMSG_SPACE(sizeof(int) * 16)];
    struct iovec iov = {frame, n + 4};
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    memset(control, 0, sizeof control);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (n_fds > 0) {
        msg.msg_control = control;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)n_fds);
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)n_fds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)n_fds);
    }
    size_t sent = 0;
    while (sent < n + 4) {
        ssize_t k = sendmsg(sock, &msg, MSG_NOSIGNAL);
        if (k <= 0) {
            perror("serve_send");
            ++failures;
            break;
        }
        sent += (size_t)k;
        iov.iov_base = frame + sent;
        iov.iov_len = n + 4 - sent;
        msg.msg_control = NULL; /* the fds ride on the first byte only */
        msg.msg_controllen = 0;
    }
    free(frame);
}

static int read_exactly(int sock, void *buf, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t k = read(sock, (char *)buf + got, n - got);
        if (k <= 0) return -1;
        got += (size_t)k;
    }
    return 0;
}

/* The provider's next frame (hello or a reply), NUL-terminated and malloc'd; "" at EOF. */
static char *serve_receive(int sock) {
    unsigned char length[4];
    if (read_exactly(sock, length, 4) != 0) {
        char *none = malloc(1);
        none[0] = '\0';
        return none;
    }
    size_t n = (size_t)length[0] | (size_t)length[1] << 8 | (size_t)length[2] << 16 | (size_t)length[3] << 24;
    char *body = malloc(n + 1);
    CHECK(read_exactly(sock, body, n) == 0);
    body[n] = '\0';
    return body;
}

#define CHECK_REPLY(sock, word)             \
    do {                                    \
        char *reply_ = serve_receive(sock); \
        CHECK_CONTAINS(reply_, (word));     \
        free(reply_);                       \
    } while (0)

/* A decoder with a share sent to this test's broker socket: the message and the fds
 * serve would forward in a region request. */
struct decoder_share {
    struct kvshare_decoder *d;
    uint64_t share_id;
    char *message;
    int fds[16];
    int n_fds;
};

static void open_decoder_share(const char *model, const char *name, struct decoder_share *s) {
    struct kvshare_kv_params params = small_params();
    char socket_path[4096];
    memset(s, 0, sizeof *s);
    CHECK_RC(kvshare_decoder_open(model, &params, &s->d), 0);
    int listener = listen_at(name, socket_path, sizeof socket_path);
    CHECK_RC(kvshare_decoder_share(s->d, socket_path, 2000, &s->share_id), 0);
    s->message = receive_share(listener, s->fds, 16, &s->n_fds);
    close(listener);
    unlink(socket_path);
}

static void close_decoder_share(struct decoder_share *s) {
    for (int i = 0; i < s->n_fds; ++i) close(s->fds[i]);
    free(s->message);
    kvshare_decoder_close(s->d);
}

/* serve's region request: the decoder's message as "share", its fds alongside. The test
 * keeps its own copies of the fds (SCM_RIGHTS duplicates them). */
static void serve_send_region(int sock, uint64_t region_id, const struct decoder_share *s) {
    size_t n = strlen(s->message) + 128;
    char *json = malloc(n);
    snprintf(json, n, "{\"kvshare_provider\":1,\"op\":\"region\",\"region_id\":%llu,\"share\":%s}",
             (unsigned long long)region_id, s->message);
    serve_send(sock, json, s->fds, s->n_fds);
    free(json);
}

static void serve_send_prefill_shared(int sock, uint64_t region_id, uint64_t share_id, uint32_t n_cached,
                                      const char *tokens) {
    char json[512];
    snprintf(json, sizeof json,
             "{\"kvshare_provider\":1,\"op\":\"prefill\",\"route\":\"shared\",\"region_id\":%llu,\"share_id\":%llu,"
             "\"n_cached\":%u,\"tokens\":[%s]}",
             (unsigned long long)region_id, (unsigned long long)share_id, n_cached, tokens);
    serve_send(sock, json, NULL, 0);
}

/* Writes f32 rows into cells pos0..pos0+n-1 of layer 0 of the region (value = cell + 1,
 * V negated), as an engine's prefill of those ids would. */
static void scatter_cells(struct kvshare_provider *p, uint32_t pos0, uint32_t n) {
    struct kvshare_tensor_info k = {.struct_size = sizeof k}, v = {.struct_size = sizeof v};
    CHECK_RC(kvshare_provider_tensor(p, "cache_k_l0", &k), 0);
    CHECK_RC(kvshare_provider_tensor(p, "cache_v_l0", &v), 0);
    const uint32_t n_k = (uint32_t)k.ne[0], n_v = (uint32_t)v.ne[0];
    float *rows = calloc((size_t)n * (n_k + n_v), sizeof(float));
    for (uint32_t t = 0; t < n; ++t)
        for (uint32_t j = 0; j < n_k + n_v; ++j)
            rows[t * (n_k + n_v) + j] = (float)(pos0 + t + 1) * (j < n_k ? 1.0f : -1.0f);
    CHECK_RC(kvshare_provider_begin_write(p), 0);
    CHECK_RC(kvshare_provider_scatter(p, 0, pos0, n, 0 /* F32 */, rows, (n_k + n_v) * sizeof(float), n_k, n_v), 0);
    CHECK_RC(kvshare_provider_end_write(p), 0);
    free(rows);
}

/* Layer 0's K of `cell` in the decoder's own mapping, as f16 bits of its first element. */
static uint16_t decoder_k_cell(struct kvshare_decoder *d, uint32_t cell) {
    struct kvshare_tensor_info k = {.struct_size = sizeof k};
    CHECK_RC(kvshare_decoder_tensor(d, "cache_k_l0", &k), 0);
    return ((const uint16_t *)k.data)[(size_t)cell * (size_t)k.ne[0]];
}

/* The resident shared route end to end over a socket pair: hello, one region, two prefills
 * into it (the second incremental, with no region resent), END when serve closes. */
static void resident_region_then_prefills_land_in_the_decoders_cells(void) {
    const char *model = model_path("llama", 3);
    struct decoder_share s;
    open_decoder_share(model, "capi-resident.sock", &s);
    int pair[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
    const int serve = pair[0];
    struct kvshare_resident *r = NULL;
    CHECK_RC(kvshare_resident_from_fd(pair[1], model, &r), 0);
    CHECK_RC(kvshare_resident_hello(r, KVSHARE_ROUTE_SHARED | KVSHARE_ROUTE_FILE, 1), 0);
    char *hello = serve_receive(serve);
    CHECK_CONTAINS(hello, "\"op\":\"hello\",\"ok\":true");
    CHECK_CONTAINS(hello, "\"routes\":[\"shared\",\"file\"],\"cached\":true");
    free(hello);

    serve_send_region(serve, 1, &s);
    serve_send_prefill_shared(serve, 1, s.share_id, 0, "11,12,13,14");
    serve_send_prefill_shared(serve, 1, s.share_id, 4, "11,12,13,14,15,16");
    struct kvshare_resident_request q = {.struct_size = sizeof q};
    CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
    CHECK(q.kind == KVSHARE_REQUEST_REGION && q.region_id == 1 && q.region != NULL);
    CHECK(q.kv.struct_size == sizeof q.kv && q.kv.n_ctx == 256 && q.kv.type_k == 1 && q.kv.flash_attn == 1);
    if (q.region == NULL) {
        kvshare_resident_close(r);
        close(serve);
        close_decoder_share(&s);
        return;
    }
    CHECK(kvshare_provider_kv_size(q.region) == 256);
    CHECK(kvshare_provider_n_chunks(q.region) == kvshare_decoder_n_chunks(s.d));
    struct kvshare_provider *region = q.region; /* the handle's: valid until the next REGION */
    CHECK_RC(kvshare_resident_reply_ok(r, 1.25, 0), 0);
    CHECK_REPLY(serve, "\"op\":\"region\",\"ok\":true,\"region_id\":1,\"region_ms\":1.25");

    CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
    CHECK(q.kind == KVSHARE_REQUEST_PREFILL_SHARED && q.region_id == 1 && q.share_id == s.share_id);
    CHECK(q.region == NULL && q.n_cached == 0 && q.n_tokens == 4 && q.tokens[0] == 11 && q.tokens[3] == 14);
    CHECK(q.state_file == NULL);
    scatter_cells(region, 0, 4);
    CHECK_RC(kvshare_resident_reply_ok(r, 2.5, 4), 0);
    CHECK_REPLY(serve, "\"op\":\"prefill\",\"ok\":true,\"prefill_ms\":2.5,\"n_prefilled\":4");
    CHECK(decoder_k_cell(s.d, 0) == f16_bits(1.0f) && decoder_k_cell(s.d, 3) == f16_bits(4.0f));

    /* Turn 2 on the same region: only cells 4..5 are the provider's. */
    CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
    CHECK(q.kind == KVSHARE_REQUEST_PREFILL_SHARED && q.n_cached == 4 && q.n_tokens == 6 && q.tokens[5] == 16);
    scatter_cells(region, q.n_cached, q.n_tokens - q.n_cached);
    CHECK_RC(kvshare_resident_reply_ok(r, 0.5, q.n_tokens - q.n_cached), 0);
    CHECK_REPLY(serve, "\"n_prefilled\":2");
    CHECK(decoder_k_cell(s.d, 5) == f16_bits(6.0f) && decoder_k_cell(s.d, 6) == 0);
    CHECK_RC(kvshare_decoder_adopt(s.d, 6, s.share_id), 0);

    /* serve closes between requests: END, once a session and then for good. */
    const int before_end = count_open_fds();
    close(serve);
    CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
    CHECK(q.kind == KVSHARE_REQUEST_END && q.region == NULL);
    CHECK(count_open_fds() == before_end - 2 - s.n_fds); /* serve's end, the channel, the region's fds */
    CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
    CHECK(q.kind == KVSHARE_REQUEST_END);
    CHECK_RC(kvshare_resident_reply_ok(r, 1.0, 1), -EINVAL);
    CHECK_CONTAINS(kvshare_resident_last_error(r), "no request is waiting");
    kvshare_resident_close(r);
    close_decoder_share(&s);
}

/* What kvshare_resident_next answers itself: a prefill for a region not held (ESTALE, also
 * after the engine failed a region), another model's region, a cache type llama-server does
 * not take, a route the hello did not offer. The engine sees only what it must act on. */
static void resident_answers_stale_regions_and_refused_shares_itself(void) {
    const char *model = model_path("llama", 3);
    struct decoder_share llama, qwen2;
    open_decoder_share(model, "capi-stale.sock", &llama);
    open_decoder_share(model_path("qwen2", 4), "capi-stale2.sock", &qwen2);
    int pair[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
    const int serve = pair[0];
    struct kvshare_resident *r = NULL;
    CHECK_RC(kvshare_resident_from_fd(pair[1], model, &r), 0);
    CHECK_RC(kvshare_resident_hello(r, KVSHARE_ROUTE_SHARED, 0), 0);
    free(serve_receive(serve));

    serve_send_prefill_shared(serve, 1, llama.share_id, 0, "5,6"); /* no region yet */
    serve_send_region(serve, 1, &qwen2);                           /* another model's */
    serve_send_prefill_shared(serve, 1, llama.share_id, 0, "5,6"); /* still none held */
    serve_send_region(serve, 2, &llama);
    struct kvshare_resident_request q = {.struct_size = sizeof q};
    CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
    CHECK(q.kind == KVSHARE_REQUEST_REGION && q.region_id == 2);
    CHECK_REPLY(serve,
                "\"op\":\"prefill\",\"ok\":false,\"errno\":116,\"error\":\"region 1: this provider holds no region");
    char *refused = serve_receive(serve);
    CHECK_CONTAINS(refused, "\"op\":\"region\",\"ok\":false,\"errno\":22");
    CHECK_CONTAINS(refused, "field \\\"model.arch\\\" is \\\"qwen2\\\", this provider uses \\\"llama\\\"");
    CHECK_CONTAINS(refused, "region 1 from kvshare-serve");
    free(refused);
    CHECK_REPLY(serve, "\"errno\":116");
    /* The engine fails the region: it is not held, so a prefill into it is stale too. */
    CHECK_RC(kvshare_resident_reply_error(r, ENOMEM, "no room for the context"), 0);
    CHECK_REPLY(serve, "\"op\":\"region\",\"ok\":false,\"errno\":12,\"error\":\"no room for the context\"");

    serve_send_prefill_shared(serve, 2, llama.share_id, 0, "5,6");
    serve_send_region(serve, 3, &llama);
    serve_send_prefill_shared(serve, 2, llama.share_id, 0, "5,6"); /* 3 is held now */
    serve_send_prefill_shared(serve, 3, llama.share_id, 1, "5,6"); /* the hello took no n_cached */
    serve_send(serve,
               "{\"kvshare_provider\":1,\"op\":\"prefill\",\"route\":\"file\",\"state_file\":\"/tmp/x.bin\","
               "\"state_version\":3,\"kv\":{\"n_ctx\":256,\"type_k\":\"f16\",\"type_v\":\"f16\",\"flash_attn\":true},"
               "\"tokens\":[5,6]}",
               NULL, 0); /* not a route it offered */
    serve_send_prefill_shared(serve, 3, llama.share_id, 0, "5,6");
    CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
    CHECK(q.kind == KVSHARE_REQUEST_REGION && q.region_id == 3);
    CHECK_REPLY(serve, "\"errno\":116,\"error\":\"region 2: this provider holds no region");
    CHECK_RC(kvshare_resident_reply_ok(r, 1.0, 0), 0);
    CHECK_REPLY(serve, "\"region_id\":3");
    CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
    CHECK(q.kind == KVSHARE_REQUEST_PREFILL_SHARED && q.region_id == 3 && q.n_cached == 0);
    CHECK_REPLY(serve, "\"errno\":116,\"error\":\"region 2: this provider holds region 3; send region 2 again");
    CHECK_REPLY(serve, "\"errno\":95,\"error\":\"n_cached 1: this provider prefills whole prompts only");
    CHECK_REPLY(serve, "\"errno\":95,\"error\":\"this provider does not take the file route");
    CHECK_RC(kvshare_resident_reply_error(r, EIO, NULL), 0);
    CHECK_REPLY(serve, "\"errno\":5,\"error\":\"Input/output error\"");

    close(serve);
    CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
    CHECK(q.kind == KVSHARE_REQUEST_END);
    kvshare_resident_close(r);
    close_decoder_share(&qwen2);
    close_decoder_share(&llama);
}

/* The file route: serve's KV params as the C struct, the state file and version; a cache
 * type llama-server does not take is answered before the engine sees it. */
static void resident_hands_out_file_prefills_with_their_kv_params(void) {
    int pair[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
    const int serve = pair[0];
    struct kvshare_resident *r = NULL;
    CHECK_RC(kvshare_resident_from_fd(pair[1], NULL, &r), 0);
    CHECK_RC(kvshare_resident_hello(r, KVSHARE_ROUTE_FILE, 1), 0);
    CHECK_REPLY(serve, "\"routes\":[\"file\"]");
    serve_send(serve,
               "{\"kvshare_provider\":1,\"op\":\"prefill\",\"route\":\"file\",\"state_file\":\"/tmp/a.bin\","
               "\"state_version\":3,\"kv\":{\"n_ctx\":512,\"type_k\":\"q9_0\",\"type_v\":\"f16\",\"flash_attn\":true},"
               "\"tokens\":[1]}",
               NULL, 0);
    serve_send(serve,
               "{\"kvshare_provider\":1,\"op\":\"prefill\",\"route\":\"file\",\"state_file\":\"/tmp/b.bin\","
               "\"state_version\":3,\"kv\":{\"n_ctx\":512,\"type_k\":\"q8_0\",\"type_v\":\"f16\",\"flash_attn\":false},"
               "\"tokens\":[7,8,9]}",
               NULL, 0);
    serve_send_prefill_shared(serve, 1, 1, 0, "1");
    struct kvshare_resident_request q = {.struct_size = sizeof q};
    CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
    CHECK(q.kind == KVSHARE_REQUEST_PREFILL_FILE && q.region_id == 0 && q.region == NULL);
    CHECK(q.state_file != NULL && strcmp(q.state_file, "/tmp/b.bin") == 0 && q.state_version == 3);
    CHECK(q.n_tokens == 3 && q.tokens[2] == 9 && q.n_cached == 0);
    CHECK(q.kv.n_ctx == 512 && q.kv.type_k == 8 /* Q8_0 */ && q.kv.type_v == 1 && q.kv.flash_attn == 0);
    CHECK(q.kv.n_seq_max == 1 && q.kv.n_ubatch == 512);
    CHECK_REPLY(serve, "\"error\":\"\\\"kv\\\" \\\"type_k\\\": ");
    /* Not answered yet: asking for the next request is refused. */
    CHECK_RC(kvshare_resident_next(r, 5000, &q), -EBUSY);
    CHECK_CONTAINS(kvshare_resident_last_error(r), "prefill request handed out last is not answered");
    CHECK(kvshare_resident_take_region(r) == NULL);
    CHECK_RC(kvshare_resident_reply_error(r, 0, "x"), -EINVAL);
    CHECK_CONTAINS(kvshare_resident_last_error(r), "errno 0");
    CHECK_RC(kvshare_resident_reply_ok(r, -1.0, 3), -EINVAL);
    CHECK_RC(kvshare_resident_reply_ok(r, 3.0, 3), 0);
    CHECK_REPLY(serve, "\"prefill_ms\":3.0,\"n_prefilled\":3");
    /* A shared prefill to a provider that offered only the file route is answered while
       next waits on; the wait then times out with the handle as it was. */
    CHECK_RC(kvshare_resident_next(r, 200, &q), -ETIMEDOUT);
    CHECK_REPLY(serve,
                "\"errno\":95,\"error\":\"this provider does not take the shared route (its hello offered file)");
    close(serve);
    CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
    CHECK(q.kind == KVSHARE_REQUEST_END);
    kvshare_resident_close(r);
}

/* --serve PATH: each serve that connects gets the hello; END between them; a region taken
 * over is the engine's to close; the socket goes with the handle. */
static void resident_listener_says_hello_to_each_serve(void) {
    const char *model = model_path("llama", 3);
    char path[4096];
    snprintf(path, sizeof path, "%s/provider.sock", work_dir);
    struct kvshare_resident *r = NULL;
    CHECK_RC(kvshare_resident_listen(path, model, &r), 0);
    struct kvshare_resident *twice = NULL;
    CHECK_RC(kvshare_resident_listen(path, model, &twice), -EEXIST);
    CHECK_CONTAINS(kvshare_resident_last_error(twice), "provider.sock");
    kvshare_resident_close(twice);
    struct kvshare_resident_request q = {.struct_size = sizeof q};
    CHECK_RC(kvshare_resident_next(r, 100, &q), -EINVAL);
    CHECK_CONTAINS(kvshare_resident_last_error(r), "kvshare_resident_hello first");
    CHECK_RC(kvshare_resident_hello(r, KVSHARE_ROUTE_SHARED, 1), 0);
    CHECK_RC(kvshare_resident_next(r, 100, &q), -ETIMEDOUT); /* nobody connected */

    struct decoder_share s;
    open_decoder_share(model, "capi-listen.sock", &s);
    for (int round = 1; round <= 2; ++round) {
        int serve = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_un addr;
        memset(&addr, 0, sizeof addr);
        addr.sun_family = AF_UNIX;
        CHECK(strlen(path) < sizeof addr.sun_path);
        memcpy(addr.sun_path, path, strlen(path) + 1 <= sizeof addr.sun_path ? strlen(path) + 1 : 0);
        CHECK(connect(serve, (struct sockaddr *)&addr, sizeof addr) == 0);
        serve_send_region(serve, 1, &s);
        CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
        CHECK(q.kind == KVSHARE_REQUEST_REGION && q.region_id == 1);
        CHECK_REPLY(serve, "\"op\":\"hello\"");
        struct kvshare_provider *taken = NULL;
        if (round == 2) {
            taken = kvshare_resident_take_region(r);
            CHECK(taken == q.region && taken != NULL);
            CHECK(kvshare_resident_take_region(r) == NULL);
        }
        CHECK_RC(kvshare_resident_reply_ok(r, 1.0, 0), 0);
        CHECK_REPLY(serve, "\"region_id\":1");
        const int before_end = count_open_fds();
        close(serve);
        CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
        CHECK(q.kind == KVSHARE_REQUEST_END);
        /* serve's end went, the handle closed its channel, and its region unless the engine took it. */
        CHECK(count_open_fds() == before_end - 2 - (round == 1 ? s.n_fds : 0));
        if (taken != NULL) {
            CHECK(kvshare_provider_kv_size(taken) == 256); /* still the engine's, still open */
            kvshare_provider_close(taken);
        }
    }
    close_decoder_share(&s);
    kvshare_resident_close(r);
    CHECK(access(path, F_OK) != 0);
}

/* Misuse is refused by name, and code written for the handle a failed open used to hand
 * back (before KVSHARE_1.5) still reports the reason and closes cleanly. */
static void resident_refuses_misuse_by_name(void) {
    struct kvshare_resident *r = NULL;
    int not_a_socket = open("/dev/null", O_RDONLY | O_CLOEXEC);
    const int before = count_open_fds();
    CHECK_RC(kvshare_resident_from_fd(not_a_socket, NULL, &r), -ENOTSOCK);
    CHECK(r == NULL);
    CHECK_CONTAINS(kvshare_resident_last_error(r), "--serve-fd");
    CHECK(count_open_fds() == before - 1); /* taken, and closed on failure */
    kvshare_resident_close(r);

    int pair[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
    char missing[4096];
    snprintf(missing, sizeof missing, "%s/no-such-model.gguf", work_dir);
    CHECK_RC(kvshare_resident_from_fd(pair[1], missing, &r), -ENOENT);
    CHECK_CONTAINS(kvshare_resident_last_error(r), "no-such-model.gguf");
    kvshare_resident_close(r);
    char *eof = serve_receive(pair[0]); /* the provider's end was closed by the failed open */
    CHECK(eof[0] == '\0');
    free(eof);
    close(pair[0]);

    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
    CHECK_RC(kvshare_resident_from_fd(pair[1], NULL, &r), 0);
    CHECK_RC(kvshare_resident_hello(r, 0, 1), -EINVAL);
    CHECK_CONTAINS(kvshare_resident_last_error(r), "routes_mask 0x0");
    CHECK_RC(kvshare_resident_hello(r, 4, 1), -EINVAL);
    CHECK_RC(kvshare_resident_hello(r, KVSHARE_ROUTE_SHARED, 1), 0);
    CHECK_RC(kvshare_resident_hello(r, KVSHARE_ROUTE_SHARED, 1), -EINVAL);
    CHECK_CONTAINS(kvshare_resident_last_error(r), "said already");
    struct kvshare_resident_request old = {.struct_size = 8};
    CHECK_RC(kvshare_resident_next(r, 100, &old), -EINVAL);
    CHECK_CONTAINS(kvshare_resident_last_error(r), "struct_size");
    /* A frame that breaks the protocol ends the session: the error once, then END. */
    free(serve_receive(pair[0]));
    serve_send(pair[0], "{\"kvshare_provider\":1,\"op\":\"hello\"}", NULL, 0);
    struct kvshare_resident_request q = {.struct_size = sizeof q};
    CHECK_RC(kvshare_resident_next(r, 5000, &q), -EINVAL);
    CHECK_CONTAINS(kvshare_resident_last_error(r), "not a request");
    CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
    CHECK(q.kind == KVSHARE_REQUEST_END);
    kvshare_resident_close(r);
    close(pair[0]);
}

static void share_requested_reads_set_and_non_empty(void) {
    unsetenv("ONEBIT_KV_SHARE");
    CHECK(kvshare_share_requested() == 0);
    setenv("ONEBIT_KV_SHARE", "", 1);
    CHECK(kvshare_share_requested() == 0);
    setenv("ONEBIT_KV_SHARE", "0", 1);
    CHECK(kvshare_share_requested() == 1);
    unsetenv("ONEBIT_KV_SHARE");
}

/* KVSHARE_1.4: llama-server -np 3 without --kv-unified, one KV stream per slot. */
static struct kvshare_kv_params three_slot_params(void) {
    struct kvshare_kv_params params = small_params();
    params.n_ctx = 768;
    params.n_seq_max = 3;
    params.kv_unified = 0;
    return params;
}

/* Shares a decoder's stream to a fresh socket; the message (malloc'd) and its fds out. */
static char *share_stream_to(struct kvshare_decoder *d, const char *name, uint32_t stream, uint64_t *share_id, int *fds,
                             int *n_fds) {
    char socket_path[4096];
    int listener = listen_at(name, socket_path, sizeof socket_path);
    char *message = NULL;
    *n_fds = 0;
    int rc = kvshare_decoder_share_stream(d, socket_path, stream, 2000, share_id);
    CHECK_RC(rc, 0);
    if (rc == 0) message = receive_share(listener, fds, 16, n_fds);
    close(listener);
    unlink(socket_path);
    return message;
}

static void share_stream_stales_only_its_own_streams_shares(void) {
    struct kvshare_kv_params params = three_slot_params();
    struct kvshare_decoder *d = NULL;
    CHECK_RC(kvshare_decoder_open(model_path("llama", 3), &params, &d), 0);
    int fds[16], n_fds = 0;
    uint64_t id = 0, s0 = 0, s1 = 0, s0_again = 0;
    char socket_path[4096];
    snprintf(socket_path, sizeof socket_path, "%s/capi-nobody.sock", work_dir);
    /* Past n_stream: refused before connecting (nobody listens there), no id spent. */
    CHECK_RC(kvshare_decoder_share_stream(d, socket_path, 3, 500, &id), -EINVAL);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "stream 3");
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "n_stream 3");

    char *message = share_stream_to(d, "capi-s0.sock", 0, &s0, fds, &n_fds);
    CHECK_CONTAINS(message, "\"stream\":0");
    for (int i = 0; i < n_fds; ++i) close(fds[i]);
    free(message);
    message = share_stream_to(d, "capi-s1.sock", 1, &s1, fds, &n_fds);
    CHECK_CONTAINS(message, "\"stream\":1");
    for (int i = 0; i < n_fds; ++i) close(fds[i]);
    free(message);
    CHECK(s0 == 1 && s1 == 2); /* ids increase across streams */

    /* Stream 1's share is not stream 0's to adopt, and the other way round. */
    CHECK_RC(kvshare_decoder_adopt_stream(d, 4, s1, 0), -EINVAL);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "stream 1");
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "stream 0");
    CHECK_RC(kvshare_decoder_adopt_stream(d, 4, s0, 1), -EINVAL);
    CHECK_RC(kvshare_decoder_adopt_stream(d, 4, s0, 3), -EINVAL);
    CHECK_RC(kvshare_decoder_adopt_stream(d, 4, s1, 1), 0);

    /* A second share of stream 0 stales stream 0's first share only. */
    message = share_stream_to(d, "capi-s0b.sock", 0, &s0_again, fds, &n_fds);
    for (int i = 0; i < n_fds; ++i) close(fds[i]);
    free(message);
    CHECK_RC(kvshare_decoder_adopt(d, 4, s0), -ESTALE);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "stream 0");
    CHECK_RC(kvshare_decoder_adopt(d, 4, s0_again), 0);
    CHECK_RC(kvshare_decoder_adopt_stream(d, 4, s1, 1), -ESTALE);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "already adopted");
    kvshare_decoder_close(d);

    /* One stream for every slot (--kv-unified with -np 2): the file route's. */
    params = small_params();
    params.n_ctx = 512;
    params.n_seq_max = 2;
    params.kv_unified = 1;
    CHECK_RC(kvshare_decoder_open(model_path("llama", 3), &params, &d), 0);
    CHECK_RC(kvshare_decoder_share_stream(d, socket_path, 0, 500, &id), -ENOTSUP);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "unified");
    CHECK_RC(kvshare_decoder_share(d, socket_path, 500, &id), -ENOTSUP);
    kvshare_decoder_close(d);
}

/* The provider writes the stream its handle names: stream 1's cells change, streams 0 and
 * 2 keep every byte, and a stream past n_stream is refused with nothing written. */
static void provider_scatter_writes_only_its_stream(void) {
    struct kvshare_kv_params params = three_slot_params();
    struct kvshare_decoder *d = NULL;
    const char *model = model_path("llama", 3);
    CHECK_RC(kvshare_decoder_open(model, &params, &d), 0);
    int fds[16], n_fds = 0;
    uint64_t share_id = 0;
    char *message = share_stream_to(d, "capi-pstream.sock", 1, &share_id, fds, &n_fds);
    char layout_path[4096], fd_list[256] = "";
    snprintf(layout_path, sizeof layout_path, "%s/capi-pstream.json", work_dir);
    if (message != NULL) write_layout_file(message, layout_path);
    free(message);
    for (int i = 0; i < n_fds; ++i)
        snprintf(fd_list + strlen(fd_list), sizeof fd_list - strlen(fd_list), "%s%d", i ? "," : "", fds[i]);
    struct kvshare_provider *p = NULL;
    CHECK_RC(kvshare_provider_open(layout_path, fd_list, model, &p), 0);
    if (failures == 0) {
        CHECK(kvshare_provider_n_stream(p) == 3);
        CHECK(kvshare_provider_stream(p) == 0);
        struct kvshare_tensor_info dk = {.struct_size = sizeof dk};
        CHECK_RC(kvshare_decoder_tensor(d, "cache_k_l0", &dk), 0);
        CHECK(dk.ne[2] == 3);
        unsigned char *before = malloc(dk.nbytes);
        memset(dk.data, 0x5a, dk.nbytes); /* the other slots' cells, as they decode */
        memcpy(before, dk.data, dk.nbytes);

        CHECK_RC(kvshare_provider_set_stream(p, 3), -EINVAL);
        CHECK_CONTAINS(kvshare_provider_last_error(p), "stream 3");
        CHECK_CONTAINS(kvshare_provider_last_error(p), "n_stream 3");
        CHECK(kvshare_provider_stream(p) == 0);
        CHECK(memcmp(before, dk.data, dk.nbytes) == 0);
        CHECK_RC(kvshare_provider_set_stream(p, 1), 0);
        CHECK(kvshare_provider_stream(p) == 1);
        scatter_cells(p, 0, 4);

        const size_t row = (size_t)dk.row_bytes, stream_bytes = row * (size_t)dk.ne[1];
        const unsigned char *cells = dk.data;
        CHECK(memcmp(before, cells, stream_bytes) == 0);                                       /* stream 0 */
        CHECK(memcmp(before + 2 * stream_bytes, cells + 2 * stream_bytes, stream_bytes) == 0); /* stream 2 */
        CHECK(memcmp(before + stream_bytes + 4 * row, cells + stream_bytes + 4 * row, stream_bytes - 4 * row) == 0);
        const uint16_t *k1 = (const uint16_t *)(cells + stream_bytes);
        CHECK(k1[0] == f16_bits(1.0f) && k1[3 * (size_t)dk.ne[0]] == f16_bits(4.0f));
        free(before);
    } else {
        fprintf(stderr, "provider open: %s\n", kvshare_provider_last_error(p));
    }
    kvshare_provider_close(p);
    CHECK(kvshare_provider_n_stream(NULL) == 1);
    CHECK_RC(kvshare_decoder_adopt_stream(d, 4, share_id, 1), 0);
    unlink(layout_path);
    kvshare_decoder_close(d);
}

/* The resident loop sets the region's stream from each prefill message; a stream past
 * n_stream is answered EINVAL before the engine sees it. */
static void resident_prefill_names_the_stream_of_the_region(void) {
    const char *model = model_path("llama", 3);
    struct decoder_share s;
    memset(&s, 0, sizeof s);
    struct kvshare_kv_params params = three_slot_params();
    CHECK_RC(kvshare_decoder_open(model, &params, &s.d), 0);
    s.message = share_stream_to(s.d, "capi-rstream.sock", 2, &s.share_id, s.fds, &s.n_fds);
    if (s.message == NULL) {
        close_decoder_share(&s);
        return;
    }
    int pair[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
    const int serve = pair[0];
    struct kvshare_resident *r = NULL;
    CHECK_RC(kvshare_resident_from_fd(pair[1], model, &r), 0);
    CHECK_RC(kvshare_resident_hello(r, KVSHARE_ROUTE_SHARED, 1), 0);
    free(serve_receive(serve));
    serve_send_region(serve, 1, &s);
    struct kvshare_resident_request q = {.struct_size = sizeof q};
    CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
    struct kvshare_provider *region = q.region;
    CHECK(q.kind == KVSHARE_REQUEST_REGION && region != NULL);
    CHECK_RC(kvshare_resident_reply_ok(r, 1.0, 0), 0);
    free(serve_receive(serve));

    char json[512];
    snprintf(json, sizeof json,
             "{\"kvshare_provider\":1,\"op\":\"prefill\",\"route\":\"shared\",\"region_id\":1,\"share_id\":%llu,"
             "\"stream\":3,\"n_cached\":0,\"tokens\":[11,12]}",
             (unsigned long long)s.share_id);
    serve_send(serve, json, NULL, 0);
    snprintf(json, sizeof json,
             "{\"kvshare_provider\":1,\"op\":\"prefill\",\"route\":\"shared\",\"region_id\":1,\"share_id\":%llu,"
             "\"stream\":2,\"n_cached\":0,\"tokens\":[11,12]}",
             (unsigned long long)s.share_id);
    serve_send(serve, json, NULL, 0);
    CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
    CHECK(q.kind == KVSHARE_REQUEST_PREFILL_SHARED && q.stream == 2);
    char *refused = serve_receive(serve);
    CHECK_CONTAINS(refused, "\"ok\":false");
    CHECK_CONTAINS(refused, "region 1: share of stream 3");
    CHECK_CONTAINS(refused, "n_stream 3");
    free(refused);
    if (region != NULL) {
        CHECK(kvshare_provider_stream(region) == 2);
        scatter_cells(region, 0, 2);
    }
    CHECK_RC(kvshare_resident_reply_ok(r, 1.0, 2), 0);
    free(serve_receive(serve));
    struct kvshare_tensor_info dk = {.struct_size = sizeof dk};
    CHECK_RC(kvshare_decoder_tensor(s.d, "cache_k_l0", &dk), 0);
    const uint16_t *k = dk.data;
    const size_t stream_elems = (size_t)dk.ne[0] * (size_t)dk.ne[1];
    CHECK(k[2 * stream_elems] == f16_bits(1.0f) && k[0] == 0 && k[stream_elems] == 0);
    CHECK_RC(kvshare_decoder_adopt_stream(s.d, 2, s.share_id, 2), 0);
    close(serve);
    kvshare_resident_close(r);
    close_decoder_share(&s);
}

/* KVSHARE_1.4, a run of cells: llama-server -np 3 with --kv-unified (every slot in one
 * stream of 512 cells). The decoder shares cells 100..139 reserved for the sequence. */
static struct kvshare_kv_params unified_three_slot_params(void) {
    struct kvshare_kv_params params = small_params();
    params.n_ctx = 512;
    params.n_seq_max = 3;
    params.kv_unified = 1;
    return params;
}

/* Every byte of the decoder's region, copied (malloc'd, *size out). */
static unsigned char *copy_region(struct kvshare_decoder *d, size_t *size) {
    size_t total = 0;
    for (uint32_t c = 0; c < kvshare_decoder_n_chunks(d); ++c) {
        void *base = NULL;
        uint64_t bytes = 0;
        CHECK_RC(kvshare_decoder_chunk(d, c, &base, &bytes), 0);
        total += bytes;
    }
    unsigned char *copy = malloc(total > 0 ? total : 1), *at = copy;
    for (uint32_t c = 0; c < kvshare_decoder_n_chunks(d); ++c) {
        void *base = NULL;
        uint64_t bytes = 0;
        CHECK_RC(kvshare_decoder_chunk(d, c, &base, &bytes), 0);
        memcpy(at, base, bytes);
        at += bytes;
    }
    *size = total;
    return copy;
}

/* Whether the region's byte at `p` (in the decoder's mapping) is in cells first..first+n-1 of
 * layer 0's K or V rows. */
static int in_layer0_cells(struct kvshare_decoder *d, const unsigned char *p, uint32_t first, uint32_t n) {
    const char *names[2] = {"cache_k_l0", "cache_v_l0"};
    for (int i = 0; i < 2; ++i) {
        struct kvshare_tensor_info t = {.struct_size = sizeof t};
        if (kvshare_decoder_tensor(d, names[i], &t) != 0) continue;
        const unsigned char *lo = (const unsigned char *)t.data + (size_t)first * (size_t)t.row_bytes;
        if (p >= lo && p < lo + (size_t)n * (size_t)t.row_bytes) return 1;
    }
    return 0;
}

static void share_cells_to_a_unified_cache_names_the_range(void) {
    struct kvshare_kv_params params = unified_three_slot_params();
    struct kvshare_decoder *d = NULL;
    const char *model = model_path("llama", 3);
    CHECK_RC(kvshare_decoder_open(model, &params, &d), 0);
    uint64_t id = 0;
    char socket_path[4096];
    snprintf(socket_path, sizeof socket_path, "%s/capi-nobody.sock", work_dir);
    /* No range on a unified cache of several slots: still the file route's. */
    CHECK_RC(kvshare_decoder_share_cells(d, socket_path, 0, 0, 0, 500, &id), -ENOTSUP);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "name the cells reserved for the sequence");
    /* Past kv_size: refused before connecting (nobody listens there), naming the numbers. */
    CHECK_RC(kvshare_decoder_share_cells(d, socket_path, 0, 500, 40, 500, &id), -EINVAL);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "first_cell 500 n_cells 40");
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "kv_size 512");

    int fds[16], n_fds = 0;
    int listener = listen_at("capi-cells.sock", socket_path, sizeof socket_path);
    const int rc = kvshare_decoder_share_cells(d, socket_path, 0, 100, 40, 2000, &id);
    CHECK_RC(rc, 0);
    CHECK(id == 1); /* the refusals spent no id */
    char *message = rc == 0 ? receive_share(listener, fds, 16, &n_fds) : NULL;
    close(listener);
    unlink(socket_path);
    CHECK_CONTAINS(message, "\"first_cell\":100,\"n_cells\":40");
    char layout_path[4096], fd_list[256] = "";
    snprintf(layout_path, sizeof layout_path, "%s/capi-cells.json", work_dir);
    if (message != NULL) write_layout_file(message, layout_path);
    free(message);
    for (int i = 0; i < n_fds; ++i)
        snprintf(fd_list + strlen(fd_list), sizeof fd_list - strlen(fd_list), "%s%d", i ? "," : "", fds[i]);
    struct kvshare_provider *p = NULL;
    CHECK_RC(kvshare_provider_open(layout_path, fd_list, model, &p), 0);
    if (failures == 0) {
        CHECK(kvshare_provider_n_cells(p) == 512 && kvshare_provider_first_cell(p) == 0);
        CHECK_RC(kvshare_provider_set_cells(p, 0, 500, 40), -EINVAL);
        CHECK_CONTAINS(kvshare_provider_last_error(p), "kv_size 512");
        CHECK_RC(kvshare_provider_set_cells(p, 1, 0, 0), -EINVAL);
        CHECK(kvshare_provider_n_cells(p) == 512 && kvshare_provider_first_cell(p) == 0);
        CHECK_RC(kvshare_provider_set_cells(p, 0, 100, 40), 0);
        CHECK(kvshare_provider_first_cell(p) == 100 && kvshare_provider_n_cells(p) == 40);
        for (uint32_t c = 0; c < kvshare_decoder_n_chunks(d); ++c) {
            void *base = NULL;
            uint64_t bytes = 0;
            CHECK_RC(kvshare_decoder_chunk(d, c, &base, &bytes), 0);
            memset(base, 0x5a, bytes); /* the other slots' cells, as they decode */
        }
        size_t size = 0;
        unsigned char *before = copy_region(d, &size);

        /* 41 positions pass n_cells 40: refused, nothing written. */
        struct kvshare_tensor_info k = {.struct_size = sizeof k}, v = {.struct_size = sizeof v};
        CHECK_RC(kvshare_provider_tensor(p, "cache_k_l0", &k), 0);
        CHECK_RC(kvshare_provider_tensor(p, "cache_v_l0", &v), 0);
        const uint32_t n_k = (uint32_t)k.ne[0], n_v = (uint32_t)v.ne[0];
        float *rows = calloc((size_t)41 * (n_k + n_v), sizeof(float));
        CHECK_RC(kvshare_provider_begin_write(p), 0);
        CHECK_RC(kvshare_provider_scatter(p, 0, 0, 41, 0, rows, (n_k + n_v) * sizeof(float), n_k, n_v), -EINVAL);
        CHECK_CONTAINS(kvshare_provider_last_error(p), "n_cells 40");
        CHECK_RC(kvshare_provider_scatter(p, 0, 1, 40, 0, rows, (n_k + n_v) * sizeof(float), n_k, n_v), -EINVAL);
        CHECK_RC(kvshare_provider_end_write(p), 0);
        free(rows);
        size_t size_after = 0;
        unsigned char *after = copy_region(d, &size_after);
        CHECK(size_after == size && memcmp(before, after, size) == 0);
        free(after);

        scatter_cells(p, 0, 40); /* positions 0..39 -> cells 100..139 */
        after = copy_region(d, &size_after);
        size_t changed = 0, outside = 0, at = 0;
        for (uint32_t c = 0; c < kvshare_decoder_n_chunks(d); ++c) {
            void *base = NULL;
            uint64_t bytes = 0;
            CHECK_RC(kvshare_decoder_chunk(d, c, &base, &bytes), 0);
            for (uint64_t b = 0; b < bytes; ++b, ++at) {
                if (before[at] == after[at]) continue;
                ++changed;
                if (!in_layer0_cells(d, (const unsigned char *)base + b, 100, 40)) ++outside;
            }
        }
        CHECK(changed > 0 && outside == 0);
        CHECK(decoder_k_cell(d, 100) == f16_bits(1.0f) && decoder_k_cell(d, 139) == f16_bits(40.0f));
        CHECK(decoder_k_cell(d, 99) == 0x5a5a && decoder_k_cell(d, 140) == 0x5a5a);
        free(after);
        free(before);
        /* kvshare_provider_set_stream is set_cells(s, 0, 0): the whole stream again. */
        CHECK_RC(kvshare_provider_set_stream(p, 0), 0);
        CHECK(kvshare_provider_first_cell(p) == 0 && kvshare_provider_n_cells(p) == 512);
    } else {
        fprintf(stderr, "provider open: %s\n", kvshare_provider_last_error(p));
    }
    kvshare_provider_close(p);
    /* More tokens than the share's n_cells: ERANGE naming both. */
    CHECK_RC(kvshare_decoder_adopt_stream(d, 41, id, 0), -ERANGE);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "41 tokens");
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "n_cells 40");
    CHECK_RC(kvshare_decoder_adopt_stream(d, 40, id, 0), 0);
    unlink(layout_path);
    kvshare_decoder_close(d);
}

/* The resident loop sets the region's cells from the prefill message's range. */
/* Issue #27: two slots of a unified cache hand over at once. Shares of disjoint runs of
 * stream 0, both made before either adopt, are both adoptable; a later share whose run
 * overlaps an earlier one's makes only that one stale. */
static void shares_of_disjoint_cells_are_each_adoptable(void) {
    struct kvshare_kv_params params = unified_three_slot_params();
    struct kvshare_decoder *d = NULL;
    CHECK_RC(kvshare_decoder_open(model_path("llama", 3), &params, &d), 0);
    char socket_path[4096];
    int listener = listen_at("capi-disjoint.sock", socket_path, sizeof socket_path);
    const uint32_t runs[4][2] = {{0, 60}, {60, 57}, {200, 20}, {210, 5}}; /* the last overlaps the third */
    uint64_t ids[4] = {0, 0, 0, 0};
    for (int i = 0; i < 4; ++i) {
        int fds[16], n_fds = 0;
        const int rc = kvshare_decoder_share_cells(d, socket_path, 0, runs[i][0], runs[i][1], 2000, &ids[i]);
        CHECK_RC(rc, 0);
        if (rc == 0) free(receive_share(listener, fds, 16, &n_fds));
        for (int f = 0; f < n_fds; ++f) close(fds[f]);
    }
    close(listener);
    unlink(socket_path);
    CHECK(ids[0] < ids[1] && ids[1] < ids[2] && ids[2] < ids[3]);
    CHECK_RC(kvshare_decoder_adopt_stream(d, 57, ids[1], 0), 0);
    CHECK_RC(kvshare_decoder_adopt_stream(d, 61, ids[0], 0), -ERANGE); /* past its n_cells 60 */
    CHECK_RC(kvshare_decoder_adopt_stream(d, 60, ids[0], 0), 0);
    CHECK_RC(kvshare_decoder_adopt_stream(d, 20, ids[2], 0), -ESTALE);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "(cells 210..214) overlaps its own (cells 200..219)");
    CHECK_RC(kvshare_decoder_adopt_stream(d, 5, ids[3], 1), -EINVAL); /* stream 1 of a one-stream cache */
    CHECK_RC(kvshare_decoder_adopt_stream(d, 5, ids[3], 0), 0);
    CHECK_RC(kvshare_decoder_adopt_stream(d, 5, ids[3], 0), -ESTALE);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "already adopted");
    kvshare_decoder_close(d);
}

static void resident_prefill_sets_the_cells_of_the_region(void) {
    const char *model = model_path("llama", 3);
    struct decoder_share s;
    memset(&s, 0, sizeof s);
    struct kvshare_kv_params params = unified_three_slot_params();
    CHECK_RC(kvshare_decoder_open(model, &params, &s.d), 0);
    char socket_path[4096];
    int listener = listen_at("capi-rcells.sock", socket_path, sizeof socket_path);
    const int rc = kvshare_decoder_share_cells(s.d, socket_path, 0, 100, 40, 2000, &s.share_id);
    CHECK_RC(rc, 0);
    s.message = rc == 0 ? receive_share(listener, s.fds, 16, &s.n_fds) : NULL;
    close(listener);
    unlink(socket_path);
    if (s.message == NULL) {
        close_decoder_share(&s);
        return;
    }
    int pair[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
    const int serve = pair[0];
    struct kvshare_resident *r = NULL;
    CHECK_RC(kvshare_resident_from_fd(pair[1], model, &r), 0);
    CHECK_RC(kvshare_resident_hello(r, KVSHARE_ROUTE_SHARED, 1), 0);
    free(serve_receive(serve));
    serve_send_region(serve, 1, &s);
    struct kvshare_resident_request q = {.struct_size = sizeof q};
    CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
    struct kvshare_provider *region = q.region;
    CHECK(q.kind == KVSHARE_REQUEST_REGION && region != NULL);
    CHECK_RC(kvshare_resident_reply_ok(r, 1.0, 0), 0);
    free(serve_receive(serve));

    char json[512];
    snprintf(json, sizeof json,
             "{\"kvshare_provider\":1,\"op\":\"prefill\",\"route\":\"shared\",\"region_id\":1,\"share_id\":%llu,"
             "\"stream\":0,\"first_cell\":500,\"n_cells\":40,\"n_cached\":0,\"tokens\":[11,12]}",
             (unsigned long long)s.share_id);
    serve_send(serve, json, NULL, 0);
    snprintf(json, sizeof json,
             "{\"kvshare_provider\":1,\"op\":\"prefill\",\"route\":\"shared\",\"region_id\":1,\"share_id\":%llu,"
             "\"stream\":0,\"first_cell\":100,\"n_cells\":40,\"n_cached\":0,\"tokens\":[11,12]}",
             (unsigned long long)s.share_id);
    serve_send(serve, json, NULL, 0);
    CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
    CHECK(q.kind == KVSHARE_REQUEST_PREFILL_SHARED && q.stream == 0);
    uint32_t first = 0, n = 0;
    CHECK_RC(kvshare_resident_cells(r, &first, &n), 0);
    CHECK(first == 100 && n == 40);
    char *refused = serve_receive(serve);
    CHECK_CONTAINS(refused, "\"ok\":false");
    CHECK_CONTAINS(refused, "kv_size 512");
    free(refused);
    if (region != NULL) {
        CHECK(kvshare_provider_first_cell(region) == 100 && kvshare_provider_n_cells(region) == 40);
        scatter_cells(region, 0, 2);
    }
    CHECK_RC(kvshare_resident_reply_ok(r, 1.0, 2), 0);
    free(serve_receive(serve));
    CHECK(decoder_k_cell(s.d, 100) == f16_bits(1.0f) && decoder_k_cell(s.d, 101) == f16_bits(2.0f));
    CHECK(decoder_k_cell(s.d, 0) == 0);
    CHECK_RC(kvshare_decoder_adopt_stream(s.d, 2, s.share_id, 0), 0);
    close(serve);
    kvshare_resident_close(r);
    close_decoder_share(&s);
}

/* ---- KVSHARE_1.5: struct_size (kvshare.h, "Versioned structs") ---- */

/* A struct with room past this library's: what a caller built against a newer header passes. */
union larger_kv_params {
    struct kvshare_kv_params params;
    unsigned char bytes[sizeof(struct kvshare_kv_params) + 16];
};
union larger_tensor_info {
    struct kvshare_tensor_info info;
    unsigned char bytes[sizeof(struct kvshare_tensor_info) + 16];
};
union larger_request {
    struct kvshare_resident_request request;
    unsigned char bytes[sizeof(struct kvshare_resident_request) + 16];
};

/* A resident provider on a socket pair, its hello said for the file route, and one file
 * prefill of ids 7, 8, 9 sent by the test playing serve (*serve). */
static struct kvshare_resident *resident_with_a_file_prefill(int *serve) {
    int pair[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
    *serve = pair[0];
    struct kvshare_resident *r = NULL;
    CHECK_RC(kvshare_resident_from_fd(pair[1], NULL, &r), 0);
    CHECK_RC(kvshare_resident_hello(r, KVSHARE_ROUTE_FILE, 0), 0);
    free(serve_receive(*serve));
    serve_send(*serve,
               "{\"kvshare_provider\":1,\"op\":\"prefill\",\"route\":\"file\",\"state_file\":\"/tmp/v.bin\","
               "\"state_version\":3,\"kv\":{\"n_ctx\":512,\"type_k\":\"q8_0\",\"type_v\":\"f16\",\"flash_attn\":true},"
               "\"tokens\":[7,8,9]}",
               NULL, 0);
    return r;
}

/* Answers the prefill handed out, if one was, and closes both ends. */
static void finish_resident(struct kvshare_resident *r, int serve) {
    if (kvshare_resident_reply_ok(r, 1.0, 3) == 0) CHECK_REPLY(serve, "\"n_prefilled\":3");
    close(serve);
    kvshare_resident_close(r);
}

static int all_bytes_are(const unsigned char *bytes, size_t from, size_t to, unsigned char value) {
    for (size_t i = from; i < to; ++i)
        if (bytes[i] != value) return 0;
    return 1;
}

/* An older caller: a struct_size smaller than this library's struct, down to the struct's
 * first version, is accepted and the library writes no byte past it. No struct has grown
 * since its first version yet, so the smaller struct here is kvshare_resident_request's
 * first version without its tail padding; the first field a struct gains takes the same
 * path. Below the first version every struct is refused by name. */
static void a_smaller_struct_down_to_its_first_version_is_filled_only_that_far(void) {
    int serve = -1;
    struct kvshare_resident *r = resident_with_a_file_prefill(&serve);
    union larger_request older;
    memset(&older, 0xa5, sizeof older);
    older.request.struct_size = (uint32_t)KVSHARE_RESIDENT_REQUEST_SIZE_VER0;
    CHECK(KVSHARE_RESIDENT_REQUEST_SIZE_VER0 <= sizeof older.request);
    const int rc = kvshare_resident_next(r, 5000, &older.request);
    CHECK_RC(rc, 0);
    if (rc == 0) {
        CHECK(older.request.kind == KVSHARE_REQUEST_PREFILL_FILE && older.request.n_tokens == 3);
        CHECK(older.request.tokens != NULL && older.request.tokens[2] == 9);
        CHECK(older.request.kv.n_ctx == 512 && older.request.kv.type_k == 8 /* Q8_0 */);
        CHECK(older.request.struct_size == KVSHARE_RESIDENT_REQUEST_SIZE_VER0);
        CHECK(all_bytes_are(older.bytes, KVSHARE_RESIDENT_REQUEST_SIZE_VER0, sizeof older.bytes, 0xa5));
    }
    finish_resident(r, serve);

    /* kvshare_kv_params_init cannot know the caller's size: it fills the first version. */
    union larger_kv_params defaults;
    memset(&defaults, 0xa5, sizeof defaults);
    kvshare_kv_params_init(&defaults.params);
    CHECK(defaults.params.struct_size == KVSHARE_KV_PARAMS_SIZE_VER0);
    CHECK(defaults.params.n_ctx == 4096 && defaults.params.type_k == 1 && defaults.params.flash_attn == 1);
    CHECK(all_bytes_are(defaults.bytes, KVSHARE_KV_PARAMS_SIZE_VER0, sizeof defaults.bytes, 0xa5));

    char expected[256];
    struct kvshare_kv_params params = small_params();
    struct kvshare_decoder *d = NULL;
    params.struct_size = (uint32_t)KVSHARE_KV_PARAMS_SIZE_VER0;
    CHECK_RC(kvshare_decoder_open(model_path("llama", 3), &params, &d), 0);
    struct kvshare_tensor_info k = {.struct_size = (uint32_t)KVSHARE_TENSOR_INFO_SIZE_VER0 - 1};
    CHECK_RC(kvshare_decoder_tensor(d, "cache_k_l0", &k), -EINVAL);
    snprintf(
        expected, sizeof expected,
        "tensor cache_k_l0: struct kvshare_tensor_info: struct_size %u is smaller than its first version (%u bytes, "
        "KVSHARE_TENSOR_INFO_SIZE_VER0)",
        (unsigned)KVSHARE_TENSOR_INFO_SIZE_VER0 - 1, (unsigned)KVSHARE_TENSOR_INFO_SIZE_VER0);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), expected);
    kvshare_decoder_close(d);

    params.struct_size = (uint32_t)KVSHARE_KV_PARAMS_SIZE_VER0 - 1;
    CHECK_RC(kvshare_decoder_open(model_path("llama", 3), &params, &d), -EINVAL);
    snprintf(expected, sizeof expected, "struct kvshare_kv_params: struct_size %u is smaller than its first version",
             (unsigned)KVSHARE_KV_PARAMS_SIZE_VER0 - 1);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), expected);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), "set it to sizeof(struct kvshare_kv_params)");
    kvshare_decoder_close(d);
}

/* A newer caller whose fields past this library's struct are all zero (it set none this
 * library does not know) is served, and told how much was filled. */
static void a_larger_struct_with_a_zero_tail_is_accepted(void) {
    union larger_kv_params newer;
    memset(&newer, 0, sizeof newer);
    newer.params = small_params();
    newer.params.struct_size = sizeof newer;
    struct kvshare_decoder *d = NULL;
    CHECK_RC(kvshare_decoder_open(model_path("llama", 3), &newer.params, &d), 0);
    CHECK(kvshare_decoder_can_share(d) == 1);

    union larger_tensor_info info;
    memset(&info, 0, sizeof info);
    info.info.struct_size = sizeof info;
    CHECK_RC(kvshare_decoder_tensor(d, "cache_k_l0", &info.info), 0);
    CHECK(info.info.ne[1] == 256 && info.info.data != NULL);
    CHECK(info.info.struct_size == sizeof info.info); /* what this library filled */
    CHECK(all_bytes_are(info.bytes, sizeof info.info, sizeof info.bytes, 0));
    kvshare_decoder_close(d);

    int serve = -1;
    struct kvshare_resident *r = resident_with_a_file_prefill(&serve);
    union larger_request request;
    memset(&request, 0, sizeof request);
    request.request.struct_size = sizeof request;
    CHECK_RC(kvshare_resident_next(r, 5000, &request.request), 0);
    CHECK(request.request.kind == KVSHARE_REQUEST_PREFILL_FILE && request.request.n_tokens == 3);
    CHECK(request.request.struct_size == sizeof request.request);
    finish_resident(r, serve);
}

/* A newer caller that set a field this library does not know: -E2BIG naming the struct,
 * its struct_size and the offset of the first non-zero byte, before anything is done. */
static void a_larger_struct_with_a_non_zero_tail_is_refused_naming_the_offset(void) {
    char expected[256];
    union larger_kv_params newer;
    memset(&newer, 0, sizeof newer);
    newer.params = small_params();
    newer.params.struct_size = sizeof newer;
    newer.bytes[sizeof newer.params + 5] = 1;
    struct kvshare_decoder *d = NULL;
    CHECK_RC(kvshare_decoder_open(model_path("llama", 3), &newer.params, &d), -E2BIG);
    snprintf(
        expected, sizeof expected,
        "struct kvshare_kv_params: struct_size %zu is larger than this library's %zu bytes (libkvshare_c %d.%d.%d) "
        "and byte %zu is not zero",
        sizeof newer, sizeof newer.params, KVSHARE_C_API_VERSION_MAJOR, KVSHARE_C_API_VERSION_MINOR,
        KVSHARE_C_API_VERSION_PATCH, sizeof newer.params + 5);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), expected);
    CHECK(kvshare_decoder_can_share(d) == 0);
    kvshare_decoder_close(d);

    struct kvshare_kv_params params = small_params();
    CHECK_RC(kvshare_decoder_open(model_path("llama", 3), &params, &d), 0);
    union larger_tensor_info info;
    memset(&info, 0, sizeof info);
    info.info.struct_size = sizeof info;
    info.info.chunk = 77;
    info.bytes[sizeof info.info + 3] = 0x10;
    CHECK_RC(kvshare_decoder_tensor(d, "cache_k_l0", &info.info), -E2BIG);
    snprintf(expected, sizeof expected,
             "tensor cache_k_l0: struct kvshare_tensor_info: struct_size %zu is larger than "
             "this library's %zu bytes",
             sizeof info, sizeof info.info);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), expected);
    snprintf(expected, sizeof expected, "byte %zu is not zero", sizeof info.info + 3);
    CHECK_CONTAINS(kvshare_decoder_last_error(d), expected);
    CHECK(info.info.chunk == 77 && info.info.struct_size == sizeof info); /* untouched */
    kvshare_decoder_close(d);

    /* Refused before a request is taken: the prefill waits for a struct that fits. */
    int serve = -1;
    struct kvshare_resident *r = resident_with_a_file_prefill(&serve);
    union larger_request request;
    memset(&request, 0, sizeof request);
    request.request.struct_size = sizeof request;
    request.bytes[sizeof request.bytes - 1] = 1;
    CHECK_RC(kvshare_resident_next(r, 5000, &request.request), -E2BIG);
    snprintf(expected, sizeof expected, "next: struct kvshare_resident_request: struct_size %zu", sizeof request);
    CHECK_CONTAINS(kvshare_resident_last_error(r), expected);
    snprintf(expected, sizeof expected, "byte %zu is not zero", sizeof request.bytes - 1);
    CHECK_CONTAINS(kvshare_resident_last_error(r), expected);
    struct kvshare_resident_request q = {.struct_size = sizeof q};
    CHECK_RC(kvshare_resident_next(r, 5000, &q), 0);
    CHECK(q.kind == KVSHARE_REQUEST_PREFILL_FILE && q.n_tokens == 3);
    finish_resident(r, serve);
}

static char other_thread_message[4096];

/* An open that fails on another thread, keeping the message that thread sees. */
static void *fail_a_provider_open(void *unused) {
    (void)unused;
    struct kvshare_provider *p = NULL;
    CHECK_RC(kvshare_provider_open("/nonexistent/layout.json", "1", NULL, &p), -EINVAL);
    snprintf(other_thread_message, sizeof other_thread_message, "%s", kvshare_provider_last_error(NULL));
    return NULL;
}

/* Since KVSHARE_1.5 a failed open hands back no handle: *out is NULL whatever it held, and
 * *_last_error(NULL) says why, per thread. (Before, a handle that held only the message.) */
static void a_failed_open_leaves_no_handle_and_says_why(void) {
    static char not_a_handle;
    struct kvshare_provider *p = (struct kvshare_provider *)(void *)&not_a_handle;
    CHECK_RC(kvshare_provider_open("/nonexistent/layout.json", "1", NULL, &p), -EINVAL);
    CHECK(p == NULL);
    CHECK_CONTAINS(kvshare_provider_last_error(NULL), "--fds");
    /* One message whatever the kind of handle: the thread's latest failed open. */
    CHECK_CONTAINS(kvshare_decoder_last_error(NULL), "--fds");

    struct kvshare_resident *r = (struct kvshare_resident *)(void *)&not_a_handle;
    int not_a_socket = open("/dev/null", O_RDONLY | O_CLOEXEC);
    const int before = count_open_fds();
    CHECK_RC(kvshare_resident_from_fd(not_a_socket, NULL, &r), -ENOTSOCK);
    CHECK(r == NULL);
    CHECK(count_open_fds() == before - 1); /* taken, and closed on failure */
    CHECK_CONTAINS(kvshare_resident_last_error(NULL), "--serve-fd");

    r = (struct kvshare_resident *)(void *)&not_a_handle;
    CHECK_RC(kvshare_resident_listen("relative.sock", NULL, &r), -EINVAL);
    CHECK(r == NULL);
    CHECK_CONTAINS(kvshare_resident_last_error(NULL), "--serve relative.sock");

    CHECK_RC(kvshare_provider_open("/nonexistent/layout.json", "3", NULL, NULL), -EINVAL);
    CHECK_CONTAINS(kvshare_provider_last_error(NULL), "kvshare_provider_open: out is NULL");

    /* Thread-local: an open failing on another thread leaves this thread's message alone. */
    pthread_t other;
    CHECK(pthread_create(&other, NULL, fail_a_provider_open, NULL) == 0);
    CHECK(pthread_join(other, NULL) == 0);
    CHECK_CONTAINS(other_thread_message, "--fds");
    CHECK_CONTAINS(kvshare_provider_last_error(NULL), "kvshare_provider_open: out is NULL");
}

/* KVSHARE_1.5: the library reports the version its header names, and its file carries it
 * too (capi/CMakeLists.txt's VERSION): one version in three places. */
static void version_query_matches_the_header_and_the_library_file(void) {
    CHECK(kvshare_version_major() == KVSHARE_C_API_VERSION_MAJOR);
    CHECK(kvshare_version_minor() == KVSHARE_C_API_VERSION_MINOR);
    CHECK(kvshare_version_patch() == KVSHARE_C_API_VERSION_PATCH);
    CHECK(KVSHARE_C_API_VERSION ==
          KVSHARE_C_API_VERSION_MAJOR * 10000 + KVSHARE_C_API_VERSION_MINOR * 100 + KVSHARE_C_API_VERSION_PATCH);
    CHECK(KVSHARE_C_API_VERSION >= 10500); /* no longer the 1 of KVSHARE_1.0 to 1.4 */
    CHECK(KVSHARE_C_API_MINOR == KVSHARE_C_API_VERSION_MINOR);

    /* "At least": true for this version and every earlier one, false for any later one. */
    CHECK(kvshare_check_version(KVSHARE_C_API_VERSION_MAJOR, KVSHARE_C_API_VERSION_MINOR) == 1);
    CHECK(kvshare_check_version(1, 0) == 1);
    CHECK(kvshare_check_version(0, 99) == 1);
    CHECK(kvshare_check_version(KVSHARE_C_API_VERSION_MAJOR, KVSHARE_C_API_VERSION_MINOR + 1) == 0);
    CHECK(kvshare_check_version(KVSHARE_C_API_VERSION_MAJOR + 1, 0) == 0);

    /* The mapped file is the real one behind the libkvshare_c.so.1 symlink. */
    char expected[64], line[4096], mapped[4096] = "";
    snprintf(expected, sizeof expected, "libkvshare_c.so.%d.%d.%d", KVSHARE_C_API_VERSION_MAJOR,
             KVSHARE_C_API_VERSION_MINOR, KVSHARE_C_API_VERSION_PATCH);
    FILE *maps = fopen("/proc/self/maps", "r");
    CHECK(maps != NULL);
    while (maps != NULL && fgets(line, sizeof line, maps) != NULL) {
        const char *name = strstr(line, "libkvshare_c.so");
        if (name == NULL) continue;
        snprintf(mapped, sizeof mapped, "%s", name);
        mapped[strcspn(mapped, "\n")] = '\0';
        break;
    }
    if (maps != NULL) fclose(maps);
    if (strcmp(mapped, expected) != 0)
        fprintf(stderr, "the library mapped is \"%s\", the header names %s\n", mapped, expected);
    CHECK(strcmp(mapped, expected) == 0);
}

struct test {
    const char *name;
    void (*run)(void);
};

static const struct test tests[] = {
    {"DecoderPlacesEveryCacheTensorInItsExportedChunks", decoder_places_every_cache_tensor_in_its_exported_chunks},
    {"ShareSendsOneFdPerChunkMappingTheDecodersCache", share_sends_one_fd_per_chunk_mapping_the_decoders_cache},
    {"AdoptTakesOnlyTheLatestSentShareOnce", adopt_takes_only_the_latest_sent_share_once},
    {"ADecoderThatCannotShareNamesBothCauses", a_decoder_that_cannot_share_names_both_causes},
    {"DeclineReleasesTheRegionsAndRefusesWithTheReason", decline_releases_the_regions_and_refuses_with_the_reason},
    {"ProviderScatterLandsInTheDecodersCells", provider_scatter_lands_in_the_decoders_cells},
    {"ProviderRefusesAnotherModelsLayoutAndBadFds", provider_refuses_another_models_layout_and_bad_fds},
    {"ShareRequestedReadsSetAndNonEmpty", share_requested_reads_set_and_non_empty},
    {"ProviderWritesRecurrentStateRowsIntoTheDecodersRegion",
     provider_writes_recurrent_state_rows_into_the_decoders_region},
    {"ProviderStateOfLfm2HasAZeroWideS", provider_state_of_lfm2_has_a_zero_wide_s},
    {"ResidentRegionThenPrefillsLandInTheDecodersCells", resident_region_then_prefills_land_in_the_decoders_cells},
    {"ResidentAnswersStaleRegionsAndRefusedSharesItself", resident_answers_stale_regions_and_refused_shares_itself},
    {"ResidentHandsOutFilePrefillsWithTheirKvParams", resident_hands_out_file_prefills_with_their_kv_params},
    {"ResidentListenerSaysHelloToEachServe", resident_listener_says_hello_to_each_serve},
    {"ResidentRefusesMisuseByName", resident_refuses_misuse_by_name},
    {"ShareStreamStalesOnlyItsOwnStreamsShares", share_stream_stales_only_its_own_streams_shares},
    {"ProviderScatterWritesOnlyItsStream", provider_scatter_writes_only_its_stream},
    {"ResidentPrefillNamesTheStreamOfTheRegion", resident_prefill_names_the_stream_of_the_region},
    {"ShareCellsToAUnifiedCacheNamesTheRange", share_cells_to_a_unified_cache_names_the_range},
    {"SharesOfDisjointCellsAreEachAdoptable", shares_of_disjoint_cells_are_each_adoptable},
    {"ResidentPrefillSetsTheCellsOfTheRegion", resident_prefill_sets_the_cells_of_the_region},
    {"VersionQueryMatchesTheHeaderAndTheLibraryFile", version_query_matches_the_header_and_the_library_file},
    {"AFailedOpenLeavesNoHandleAndSaysWhy", a_failed_open_leaves_no_handle_and_says_why},
    {"ASmallerStructDownToItsFirstVersionIsFilledOnlyThatFar",
     a_smaller_struct_down_to_its_first_version_is_filled_only_that_far},
    {"ALargerStructWithAZeroTailIsAccepted", a_larger_struct_with_a_zero_tail_is_accepted},
    {"ALargerStructWithANonZeroTailIsRefusedNamingTheOffset",
     a_larger_struct_with_a_non_zero_tail_is_refused_naming_the_offset},
};

static void remove_work_dir(void) {
    if (work_dir == NULL) return;
    char command[4200];
    snprintf(command, sizeof command, "rm -rf '%s'", work_dir);
    if (system(command) != 0) fprintf(stderr, "could not remove %s\n", work_dir);
}

static void say_timed_out(int sig) {
    (void)sig;
    static const char message[] = "capi_tests: timed out after 60 s (a peer never connected?)\n";
    ssize_t ignored = write(2, message, sizeof message - 1);
    (void)ignored;
    _exit(1);
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s TEST MKMODEL WORK_DIR\n", argv[0]);
        return 2;
    }
    mkmodel = argv[2];
    models_dir = argv[3];
    /* Each test in a private 0700 directory of its own: a decoder sends its KV fds only to a
       listener in a directory no other user can reach (docs/protocol.md, Trust model). It lives
       under TMPDIR, not the build tree: a socket path must fit sun_path (107 bytes), and a
       build tree's path can be longer. */
    static char private_dir[4096];
    const char *tmp = getenv("TMPDIR");
    snprintf(private_dir, sizeof private_dir, "%s/kvshare-capi-XXXXXX", tmp != NULL && *tmp != '\0' ? tmp : "/tmp");
    if (mkdtemp(private_dir) == NULL) {
        fprintf(stderr, "mkdtemp %s: %s\n", private_dir, strerror(errno));
        return 1;
    }
    work_dir = private_dir;
    atexit(remove_work_dir);
    /* A share that fails leaves receive_share() waiting in accept(): end with a message
       well before ctest's timeout instead. */
    signal(SIGALRM, say_timed_out);
    alarm(60);
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; ++i) {
        if (strcmp(argv[1], tests[i].name) != 0) continue;
        model_path("llama", 3); /* made before counting: system() is not the code under test */
        model_path("qwen2", 4);
        model_path("qwen35", 5);
        model_path("lfm2", 6);
        const int before = count_open_fds();
        tests[i].run();
        const int after = count_open_fds();
        if (after != before) {
            fprintf(stderr, "%s: %d descriptor(s) open before, %d after: leaked\n", tests[i].name, before, after);
            ++failures;
        }
        fprintf(stderr, "%s: %s\n", tests[i].name, failures == 0 ? "passed" : "FAILED");
        return failures == 0 ? 0 : 1;
    }
    fprintf(stderr, "%s: no test named %s\n", argv[0], argv[1]);
    return 2;
}
