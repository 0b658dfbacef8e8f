/* The read-bandwidth probe (the bound of a decode step), and what this build reports of itself:
 * its prefetch distance and whether it runs on OpenMP's threads. */
#include "common.h"

/* The machine's streaming read bandwidth, the bound of a decode step, which reads every weight once
 * from memory: one read-only pass over `bytes` of `buf` (64-byte aligned, a multiple of 1024; far
 * larger than the caches), each thread streaming its own contiguous share, in this build's widest
 * loads (four 512-bit loads per 256 bytes with AVX-512, the compiler's vectors elsewhere) into
 * integer sums (an add per load: no chain a load waits on). With `ahead` > 0 each pass also asks
 * for the lines `ahead` bytes further on (as the decode products do); a plain sequential read is
 * what the hardware prefetchers see best, so kernels.read_bandwidth takes the best of both. Returns
 * the sum of the buffer's 64-bit words modulo 2^64, so that no load can be dropped (and a test can
 * check that every word was read once). */
uint64_t attnlab_read_pass(const uint8_t *buf, int64_t bytes, int threads, int64_t ahead) {
  uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    int64_t lo, hi;
    /* in 64-byte lines, each thread's in whole multiples of 16 lines */
    share(bytes / 64, &lo, &hi);
    const uint8_t *p = buf + 64 * lo, *end = buf + 64 * hi;
#if AVX512
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (; p + 256 <= end; p += 256) {
      if (ahead)
        for (int k = 0; k < 256; k += 64) __builtin_prefetch(p + k + ahead, 0, 3);
      a0 = _mm512_add_epi64(a0, _mm512_load_si512((const void *)p));
      a1 = _mm512_add_epi64(a1, _mm512_load_si512((const void *)(p + 64)));
      a2 = _mm512_add_epi64(a2, _mm512_load_si512((const void *)(p + 128)));
      a3 = _mm512_add_epi64(a3, _mm512_load_si512((const void *)(p + 192)));
    }
    total += (uint64_t)_mm512_reduce_add_epi64(
        _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
#endif
    uint64_t s = 0;
    /* the other builds: 256 bytes per pass, vectorised by the compiler */
    for (; p + 256 <= end; p += 256) {
      const uint64_t *q = (const uint64_t *)p;
      if (ahead)
        for (int k = 0; k < 256; k += 64) __builtin_prefetch(p + k + ahead, 0, 3);
#pragma omp simd reduction(+ : s)
      for (int i = 0; i < 32; i++) s += q[i];
    }
    total += s;
  }
  return total;
}

/* The distance attnlab_read_pass's prefetching pass asks ahead: the decode products' */
int64_t attnlab_prefetch_ahead(void) { return PREFETCH_AHEAD; }

/* Whether this build runs its parallel regions on several threads: _OPENMP's date (OpenMP's
 * version) when it was compiled with OpenMP, 0 without (Apple's clang; clang without libomp): then
 * every pragma above but `omp simd` is ignored, each kernel runs on the calling thread, and the
 * thread index every share is computed from is 0 of 1. */
int attnlab_openmp(void) {
#ifdef _OPENMP
  return _OPENMP;
#else
  return 0;
#endif
}
