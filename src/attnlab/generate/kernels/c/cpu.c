/* What this x86-64 CPU and its operating system let a program run: the instruction sets of
 * the kernels' builds (kernels.c).
 *
 * A CPU flag is not permission. CPUID says what the processor implements; whether the operating
 * system saves and restores the wider registers on a context switch is XCR0 (read with xgetbv,
 * allowed once CPUID reports OSXSAVE): bits 1-2 for SSE and AVX state (ymm), 5-7 for AVX-512
 * (opmask, zmm upper halves, zmm16-31). An instruction set whose state the OS does not manage
 * faults (#UD) even though CPUID lists it. (Intel SDM vol. 1, 13.2 and 15.2; the same test as gcc's
 * __builtin_cpu_supports and llama.cpp's ggml-cpu feature probe.) Built with no -m flags, so that
 * it runs anywhere; on other processors it reports nothing. */
#include <stdint.h>

/* attnlab.generate.kernels.CpuLevel: the same bits */
enum { ATTNLAB_CPU_AVX2 = 1, ATTNLAB_CPU_AVX512 = 2 };

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static uint64_t xcr0(void) {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((uint64_t)hi << 32) | lo;
}

/* ATTNLAB_CPU_* bits: AVX2 = AVX2 + FMA + F16C with ymm state enabled; AVX512 = AVX-512 F, BW, VL,
 * DQ and VNNI with zmm and opmask state enabled (the instructions the kernels' two x86 builds are
 * compiled for) */
int attnlab_cpu_levels(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  int osxsave = (c >> 27) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1, avx = (c >> 28) & 1;
  if (!osxsave || !avx) return 0;
  uint64_t state = xcr0();
  if ((state & 0x6) != 0x6) return 0; /* the OS saves neither xmm nor ymm */
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
  int avx2 = (b >> 5) & 1;
  int levels = (avx2 && fma && f16c) ? ATTNLAB_CPU_AVX2 : 0;
  int f = (b >> 16) & 1, dq = (b >> 17) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1,
      vnni = (c >> 11) & 1;
  if (levels && f && dq && bw && vl && vnni && (state & 0xE0) == 0xE0) levels |= ATTNLAB_CPU_AVX512;
  return levels;
}
#else
int attnlab_cpu_levels(void) { return 0; }
#endif
