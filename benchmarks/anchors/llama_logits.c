/* llama.cpp's logits at every position of a list of token ids: an anchor for the benchmarks.
 *
 *   llama_logits MODEL.gguf IDS.txt OUT.npy [THREADS [EXTRA_BUFFERS]]
 *
 * IDS.txt holds the token ids as decimal numbers separated by white space; OUT.npy receives
 * float32 logits of shape (n_tokens, n_vocab), row t the logits after ids[0..t] (numpy's .npy
 * format, version 1.0, C order). The last line of stdout is llama.cpp's system information
 * (llama_print_system_info: the CPU features its kernels use), for the record. EXTRA_BUFFERS 0
 * turns off llama.cpp's extra weight buffers (use_extra_bufts: the CPU's repacked layouts and
 * AMX tiles), which a build for another CPU may not run; 1, llama.cpp's default.
 *
 * Design choices (the point is to see llama.cpp's own arithmetic on the file's weights):
 * - One llama_decode of the whole list as one batch and one micro-batch, one sequence, every
 *   position marked for output, positions 0..n-1: the logits of a prompt as llama.cpp's prompt
 *   processing computes them.
 * - The KV cache in float32 and flash attention off, so that the keys, values and attention
 *   scores are not rounded to float16 on the way: what differs from a float32 reference is the
 *   weights' format and llama.cpp's activations, quantized to 8 bits for its quantized products.
 * - Only llama.h's public API (libllama.so), no llama.cpp example code.
 * Built on demand by benchmarks/_llama_logits.py; never a part of attnlab.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static void quiet_log(enum ggml_log_level level, const char *text, void *user_data) {
  (void)user_data;
  if (level >= GGML_LOG_LEVEL_ERROR) {
    fputs(text, stderr);
  }
}

static int fail(const char *message, const char *detail) {
  fprintf(stderr, "llama_logits: %s%s%s\n", message, detail ? ": " : "", detail ? detail : "");
  return 1;
}

/* Reads every decimal id of `path` into a growing array; returns the count, -1 on an error. */
static int32_t read_ids(const char *path, llama_token **ids) {
  FILE *file = fopen(path, "r");
  if (!file) {
    return -1;
  }
  int32_t count = 0, capacity = 256;
  *ids = malloc(sizeof(llama_token) * (size_t)capacity);
  long value;
  while (*ids && fscanf(file, "%ld", &value) == 1) {
    if (count == capacity) {
      capacity *= 2;
      llama_token *grown = realloc(*ids, sizeof(llama_token) * (size_t)capacity);
      if (!grown) {
        free(*ids);
        *ids = NULL;
        break;
      }
      *ids = grown;
    }
    (*ids)[count++] = (llama_token)value;
  }
  int trailing = !feof(file);
  fclose(file);
  return (*ids && !trailing) ? count : -1;
}

/* numpy's .npy v1.0: magic, version, a little-endian uint16 header length, a Python dict literal
 * padded with spaces to a multiple of 64 bytes and ending in a newline, then the data. */
static int write_npy(const char *path, const float *data, int32_t rows, int32_t cols) {
  char header[128];
  int length =
      snprintf(header, sizeof(header),
               "{'descr': '<f4', 'fortran_order': False, 'shape': (%" PRId32 ", %" PRId32 "), }",
               rows, cols);
  int total = 10 + length + 1;
  int padded = (total + 63) / 64 * 64;
  FILE *file = fopen(path, "wb");
  if (!file) {
    return -1;
  }
  uint16_t header_length = (uint16_t)(padded - 10);
  unsigned char start[10] = {0x93,
                             'N',
                             'U',
                             'M',
                             'P',
                             'Y',
                             1,
                             0,
                             (unsigned char)(header_length & 0xFF),
                             (unsigned char)(header_length >> 8)};
  fwrite(start, 1, sizeof(start), file);
  fwrite(header, 1, (size_t)length, file);
  for (int i = total; i < padded; i++) {
    fputc(' ', file);
  }
  fputc('\n', file);
  size_t count = (size_t)rows * (size_t)cols;
  size_t written = fwrite(data, sizeof(float), count, file);
  return (fclose(file) == 0 && written == count) ? 0 : -1;
}

int main(int argc, char **argv) {
  if (argc < 4 || argc > 6) {
    fprintf(stderr, "usage: %s MODEL.gguf IDS.txt OUT.npy [THREADS [EXTRA_BUFFERS]]\n", argv[0]);
    return 2;
  }
  int32_t threads = argc >= 5 ? (int32_t)atoi(argv[4]) : 1;
  bool extra_buffers = argc == 6 ? atoi(argv[5]) != 0 : true;
  llama_token *ids = NULL;
  int32_t n_tokens = read_ids(argv[2], &ids);
  if (n_tokens <= 0) {
    return fail("no token ids read from", argv[2]);
  }

  llama_log_set(quiet_log, NULL);
  llama_backend_init();
  struct llama_model_params model_params = llama_model_default_params();
  model_params.use_extra_bufts = extra_buffers;
  struct llama_model *model = llama_model_load_from_file(argv[1], model_params);
  if (!model) {
    return fail("llama.cpp could not load", argv[1]);
  }
  int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  for (int32_t t = 0; t < n_tokens; t++) {
    if (ids[t] < 0 || ids[t] >= n_vocab) {
      return fail("a token id is outside the vocabulary of", argv[1]);
    }
  }

  struct llama_context_params context_params = llama_context_default_params();
  context_params.n_ctx = (uint32_t)n_tokens;
  context_params.n_batch = (uint32_t)n_tokens;
  context_params.n_ubatch = (uint32_t)n_tokens;
  context_params.n_seq_max = 1;
  context_params.n_threads = threads;
  context_params.n_threads_batch = threads;
  context_params.type_k = GGML_TYPE_F32;
  context_params.type_v = GGML_TYPE_F32;
  context_params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  context_params.no_perf = true;
  struct llama_context *context = llama_init_from_model(model, context_params);
  if (!context) {
    return fail("llama.cpp could not make a context for", argv[1]);
  }

  struct llama_batch batch = llama_batch_init(n_tokens, 0, 1);
  batch.n_tokens = n_tokens;
  for (int32_t t = 0; t < n_tokens; t++) {
    batch.token[t] = ids[t];
    batch.pos[t] = t;
    batch.n_seq_id[t] = 1;
    batch.seq_id[t][0] = 0;
    batch.logits[t] = 1;
  }
  int32_t status = llama_decode(context, batch);
  if (status != 0) {
    char code[32];
    snprintf(code, sizeof(code), "status %" PRId32, status);
    return fail("llama_decode failed", code);
  }

  float *logits = malloc(sizeof(float) * (size_t)n_tokens * (size_t)n_vocab);
  if (!logits) {
    return fail("out of memory for the logits", NULL);
  }
  for (int32_t t = 0; t < n_tokens; t++) {
    const float *row = llama_get_logits_ith(context, t);
    if (!row) {
      return fail("llama.cpp returned no logits for a position", NULL);
    }
    memcpy(logits + (size_t)t * (size_t)n_vocab, row, sizeof(float) * (size_t)n_vocab);
  }
  if (write_npy(argv[3], logits, n_tokens, n_vocab) != 0) {
    return fail("could not write", strerror(errno));
  }
  printf("%s\n", llama_print_system_info());

  free(logits);
  free(ids);
  llama_batch_free(batch);
  llama_free(context);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
