/* Built by installed_consumer.sh against the installed package: kvshare.h and
 * -lkvshare_c are all a C program needs. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <kvshare.h>

int main(void) {
    struct kvshare_kv_params params;
    kvshare_kv_params_init(&params);
    struct kvshare_decoder *decoder = NULL;
    const int rc = kvshare_decoder_open("/nonexistent/model.gguf", &params, &decoder);
    const int ok = rc == -ENOENT && decoder != NULL && !kvshare_decoder_can_share(decoder) &&
                   strstr(kvshare_decoder_last_error(decoder), "model.gguf") != NULL;
    printf("kvshare-c consumer: open of a missing model: %d (%s)\n", rc, kvshare_decoder_last_error(decoder));
    kvshare_decoder_close(decoder);
    return ok ? 0 : 1;
}
