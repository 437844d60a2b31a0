// red_probe.cu: what one dKV reduction form costs on this GPU, without the rest of the backward.
//
// Issue #21 (a bitwise-reproducible backward) chooses between accumulators by their cost: the
// default kernel adds 4 floats with one `red.global.add.v4.f32`; wip/0124 adds one int64
// fixed-point value with one `red.global.add.u64`; a packed form would add two int32 lanes with
// one u64 (issue21-fixed-point-bounds.md, design 1). This probe issues only those reductions, in
// the backward's pattern: one CTA of 256 threads a query, the query's 2051 k-pool keys (512 random
// 4-token pools among the complete ones, causal, plus the 3 tail tokens), a 512-wide row added per
// key. It prints one markdown row per form: time, the accumulator's size, reductions issued, and
// the ratio to v4.f32; the kernel's own add pattern (64-column chunks, a warp instruction over 8
// rows x 64 B) and the same chunks as 4 rows x 128 B and 2 rows x 256 B (issue #17: what an
// exchange of values between lanes before the adds could gain at most), and the 4-row form with
// that exchange paid in shuffles (what a kernel would get); then v4.f32 with part
// of the accumulator held in L2 (a persisting access policy window), the most L2 residency of
// dKV could gain; then v4.f32 and the kernel's exchanged form with an L2 cache policy on each add
// (createpolicy + red's .L2::cache_hint, no set-aside: evict_last for a fraction of the accesses,
// or for the accumulator's first MiB), what the backward's own adds could take. Build and run on
// the GPU host:
//
//   nvcc -O3 -arch=sm_90a -o /tmp/red_probe bench/red_probe.cu && /tmp/red_probe [seq_len] [reps]
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cuda_runtime.h>

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

constexpr int D = 512, TOPK = 2048, POOL = 4, WIDTH = TOPK + POOL - 1, THREADS = 256;

__device__ __forceinline__ uint32_t mix(uint32_t x) {
  x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
  return x;
}

// key j of query q, or -1: GLM's k-pool shape (bench.py's kpool_indices draws its pools without
// repeats; a hash may repeat one, which changes nothing about the cost of an add)
__device__ __forceinline__ int key_of(int q, int j, int mask) {
  int complete = (q + 1) / POOL;
  if (j < TOPK) {
    if (complete == 0 || j / POOL >= complete) return -1;
    int pool = mix(q * 977u + j / POOL * 131u + 7u) % complete;
    return (pool * POOL + j % POOL) & mask;
  }
  int pos = complete * POOL + (j - TOPK);
  return pos <= q ? (pos & mask) : -1;
}

enum Form { V4F32, V2F32, F32, U64_PACKED, U64_ONE, ST_V4, V4_TILE, V4_TILE4, V4_TILE2, V4_TILE4X, NFORMS };
const char *names[] = {"red.global.add.v4.f32 (default: 4 floats an op)",
                       "red.global.add.v2.f32 (2 floats an op)",
                       "red.global.add.f32 (1 float an op)",
                       "red.global.add.u64, two int32 lanes (design 1: 2 values an op)",
                       "red.global.add.u64, one int64 value (wip/0124: 1 value an op)",
                       "st.global.v4.b32 (plain stores, no reduction: bytes only)",
                       "red.global.add.v4.f32 in the kernel's pattern (a warp: 8 rows x 64 B)",
                       "red.global.add.v4.f32, the kernel's chunks as a warp: 4 rows x 128 B",
                       "red.global.add.v4.f32, the kernel's chunks as a warp: 2 rows x 256 B",
                       "red.global.add.v4.f32, 4 rows x 128 B after the exchange (4 SHFL a RED pair)"};
const int values_per_op[] = {4, 2, 1, 2, 1, 4, 4, 4, 4, 4};
const int bytes_per_value[] = {4, 4, 4, 4, 8, 4, 4, 4, 4, 4};
// An L2 cache policy for the adds (PTX createpolicy; no set-aside, unlike the access policy
// window below): POL 0 none (a plain red); 1-3 createpolicy.fractional, evict_last for 50 / 75 /
// 100% of the accesses (each access draws its priority), evict_first for the rest; 4 evict_first
// for all; 5 evict_last for 50%, the rest evict_unchanged; 6-8 createpolicy.range, evict_last
// for the accumulator's first 24 / 32 / 40 MiB (the lowest keys: a causal key is visible to every
// later query, so the low keys take the most adds), evict_first past them. What the backward's
// adds could take with `.L2::cache_hint` (issue #17).
constexpr int NPOL = 9;
const char *pol_names[] = {"none", "fractional: evict_last 0.50 / evict_first",
                           "fractional: evict_last 0.75 / evict_first", "fractional: evict_last 1.00",
                           "fractional: evict_first 1.00", "fractional: evict_last 0.50 / evict_unchanged",
                           "range: first 24 MiB evict_last, the rest evict_first",
                           "range: first 32 MiB evict_last, the rest evict_first",
                           "range: first 40 MiB evict_last, the rest evict_first"};
template <int POL>
__device__ __forceinline__ uint64_t make_policy(const void *base) {
  uint64_t pol = 0;
  if constexpr (POL >= 6) {
    const uint32_t primary = (POL == 6 ? 24u : POL == 7 ? 32u : 40u) << 20, total = 0xffffffffu;
    asm volatile("createpolicy.range.global.L2::evict_last.L2::evict_first.b64 %0, [%1], %2, %3;"
                 : "=l"(pol) : "l"(base), "r"(primary), "r"(total));
  }
  if constexpr (POL == 1)
    asm volatile("createpolicy.fractional.L2::evict_last.L2::evict_first.b64 %0, 0.5;" : "=l"(pol));
  else if constexpr (POL == 2)
    asm volatile("createpolicy.fractional.L2::evict_last.L2::evict_first.b64 %0, 0.75;" : "=l"(pol));
  else if constexpr (POL == 3)
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  else if constexpr (POL == 4)
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  else if constexpr (POL == 5)
    asm volatile("createpolicy.fractional.L2::evict_last.L2::evict_unchanged.b64 %0, 0.5;" : "=l"(pol));
  return pol;
}
template <int POL = 0>
__device__ __forceinline__ void red_v4(float *p, float a, float b, float c, float d, uint64_t pol = 0) {
  if constexpr (POL == 0)
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c),
                 "f"(d) : "memory");
  else
    asm volatile("red.global.add.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p),
                 "f"(a), "f"(b), "f"(c), "f"(d), "l"(pol) : "memory");
}

// rows a warp instruction covers in the tile forms (the kernel's 64-column chunks, 16 rows a warp)
__host__ __device__ constexpr int tile_rows(int f) { return f == V4_TILE ? 8 : f == V4_TILE4 ? 4 : 2; }

template <int F, int POL = 0>
__global__ void __launch_bounds__(THREADS) probe(void *acc, int seq, int mask) {
  const int q = blockIdx.x, t = threadIdx.x;
  const uint64_t pol = make_policy<POL>(acc);
  if constexpr (F == V4_TILE || F == V4_TILE4 || F == V4_TILE2) {
    // as sparse_mla_bwd_ws64 adds a 64-key block's dKV chunk of 64 columns: warp w of a
    // warpgroup adds rows 16 w .. 16 w + 15, 8 instructions of 512 B; the two warpgroups take
    // alternate chunks. V4_TILE is the kernel's own (a wgmma accumulator in line order: a lane
    // holds rows lane / 4 and + 8, 4 adjacent floats of each 16 columns, so an instruction
    // covers R = 8 rows x 64 B); V4_TILE4 / V4_TILE2 cover R = 4 / 2 rows x 512 / R bytes, what
    // the same values would give after an exchange between lanes (not paid here).
    constexpr int R = tile_rows(F), LANES_ROW = 32 / R, FLOATS_SEG = 4 * LANES_ROW;
    constexpr int SEGS = 64 / FLOATS_SEG;  // segments of a 64-column chunk row
    const int wg = t / 128, w = t % 128 / 32, lane = t % 32;
    for (int b0 = 0; b0 < WIDTH; b0 += 64) {
#pragma unroll 1
      for (int c = wg; c < D / 64; c += 2) {
#pragma unroll
        for (int rg = 0; rg < 16 / R; ++rg) {
          int j = b0 + 16 * w + rg * R + lane / LANES_ROW;
          int k = j < WIDTH ? key_of(q, j, mask) : -1;
          if (k < 0) continue;
#pragma unroll
          for (int g = 0; g < SEGS; ++g) {
            float v = 1.0f + (t & 7) * 0.125f;
            float *p = (float *)acc + (size_t)k * D + c * 64 + g * FLOATS_SEG + lane % LANES_ROW * 4;
            red_v4(p, v, v, v, v);
          }
        }
      }
    }
    return;
  }
  if constexpr (F == V4_TILE4X) {
    // V4_TILE's registers (a lane: rows lane / 4 and + 8, 4 floats of each 16-column group),
    // exchanged with the lane 4 quads away before the adds: for each half of the warp's rows
    // and each pair of groups g, g + 1, quad q < 4 keeps row q's g and takes row q + 4's g,
    // quad q + 4 keeps row q + 4's g + 1 and takes row q's g + 1; then one RED covers rows
    // 0-3 and the next rows 4-7 of the half, 128 B each. The shuffles are paid here.
    const int wg = t / 128, w = t % 128 / 32, lane = t % 32, quad = lane / 4;
    const bool hi = quad >= 4;
    for (int b0 = 0; b0 < WIDTH; b0 += 64) {
#pragma unroll 1
      for (int c = wg; c < D / 64; c += 2) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          int base = b0 + 16 * w + 8 * half;
          int jq = base + (quad & 3), jq4 = jq + 4;  // the rows this lane adds: q and q + 4
          int kq = jq < WIDTH ? key_of(q, jq, mask) : -1;
          int kq4 = jq4 < WIDTH ? key_of(q, jq4, mask) : -1;
#pragma unroll
          for (int g = 0; g < 4; g += 2) {
            float own[2][4], got[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              own[0][e] = 1.0f + (t & 7) * 0.125f + e + g;
              own[1][e] = 2.0f + (t & 7) * 0.125f + e + g;
            }
#pragma unroll
            for (int e = 0; e < 4; ++e)
              got[e] = __shfl_xor_sync(0xffffffffu, hi ? own[0][e] : own[1][e], 16);
            // first RED: row q (quad q: own g; quad q + 4: received g + 1); second: row q + 4
            const float *v1 = hi ? got : own[0], *v2 = hi ? own[1] : got;
            int col = c * 64 + (g + hi) * 16 + lane % 4 * 4;
            if (kq >= 0) {
              float *p = (float *)acc + (size_t)kq * D + col;
              red_v4<POL>(p, v1[0], v1[1], v1[2], v1[3], pol);
            }
            if (kq4 >= 0) {
              float *p = (float *)acc + (size_t)kq4 * D + col;
              red_v4<POL>(p, v2[0], v2[1], v2[2], v2[3], pol);
            }
          }
        }
      }
    }
    return;
  }
  // per row: D / values_per_op ops; 256 threads take them in turn over the query's keys
  constexpr int vpo = F == V4F32 || F == ST_V4 ? 4 : (F == F32 || F == U64_ONE ? 1 : 2);
  constexpr int ops_row = D / vpo;
  constexpr int rows_at_once = THREADS >= ops_row ? THREADS / ops_row : 1;
  constexpr int ops_thread = ops_row > THREADS ? ops_row / THREADS : 1;
  const int sub = t / (THREADS / rows_at_once) % rows_at_once;
  const int lane = t % (THREADS / rows_at_once);
  for (int j0 = 0; j0 < WIDTH; j0 += rows_at_once) {
    int j = j0 + sub;
    if (j >= WIDTH) break;
    int k = key_of(q, j, mask);
    if (k < 0) continue;
#pragma unroll
    for (int o = 0; o < ops_thread; ++o) {
      int op = lane + o * (THREADS / rows_at_once);
      float v = 1.0f + (t & 7) * 0.125f;
      if constexpr (F == V4F32) {
        float *p = (float *)acc + (size_t)k * D + op * 4;
        red_v4<POL>(p, v, v, v, v, pol);
      } else if constexpr (F == V2F32) {
        float *p = (float *)acc + (size_t)k * D + op * 2;
        asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(v), "f"(v) : "memory");
      } else if constexpr (F == F32) {
        float *p = (float *)acc + (size_t)k * D + op;
        asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
      } else if constexpr (F == U64_PACKED) {
        uint64_t *p = (uint64_t *)acc + (size_t)k * (D / 2) + op;
        int32_t lo = 3 + t, hi = -5 - t;  // lo sign-extended: (hi << 32) + lo
        uint64_t x = ((uint64_t)(int64_t)hi << 32) + (uint64_t)(int64_t)lo;
        asm volatile("red.global.add.u64 [%0], %1;" ::"l"(p), "l"(x) : "memory");
      } else if constexpr (F == U64_ONE) {
        uint64_t *p = (uint64_t *)acc + (size_t)k * D + op;
        asm volatile("red.global.add.u64 [%0], %1;" ::"l"(p), "l"((uint64_t)(3 + t)) : "memory");
      } else {
        float *p = (float *)acc + (size_t)k * D + op * 4;
        asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(__float_as_uint(v)),
                     "r"(__float_as_uint(v)), "r"(__float_as_uint(v)), "r"(__float_as_uint(v))
                     : "memory");
      }
    }
  }
}

// the packed form's postprocess, checked once: a lane's final sum is recovered from the u64 total
__global__ void unpack_check(const uint64_t *acc, const int64_t *expect_lo, const int64_t *expect_hi,
                             int n, int *bad) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint64_t tot = acc[i];
  int64_t lo = (int64_t)(int32_t)(uint32_t)tot;
  int64_t hi = (int64_t)(tot - (uint64_t)lo) >> 32;
  if (lo != expect_lo[i] || hi != expect_hi[i]) atomicAdd(bad, 1);
}

template <int F, int POL = 0>
float run(void *acc, size_t bytes, int seq, int mask, int reps, cudaStream_t st = 0) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  float best = 1e30f;
  for (int r = 0; r < reps + 1; ++r) {  // the first is a warm-up
    CHECK(cudaMemsetAsync(acc, 0, bytes, st));
    CHECK(cudaEventRecord(a, st));
    probe<F, POL><<<seq, THREADS, 0, st>>>(acc, seq, mask);
    CHECK(cudaEventRecord(b, st));
    CHECK(cudaEventSynchronize(b));
    CHECK(cudaGetLastError());
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (r > 0 && ms < best) best = ms;
  }
  return best;
}

int main(int argc, char **argv) {
  int seq = argc > 1 ? atoi(argv[1]) : 32768;
  int reps = argc > 2 ? atoi(argv[2]) : 5;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("# red_probe: %s, L2 %d MiB, %d tokens, top-k %d, %d-wide rows, best of %d\n\n", prop.name,
         prop.l2CacheSize >> 20, seq, WIDTH, D, reps);
  void *acc;
  size_t max_bytes = (size_t)seq * D * 8;
  CHECK(cudaMalloc(&acc, max_bytes));
  // valid (query, key) pairs, counted on the host the way key_of draws them
  double pairs = 0;
  for (int q = 0; q < seq; ++q) {
    int complete = (q + 1) / POOL;
    pairs += (complete < TOPK / POOL ? complete : TOPK / POOL) * POOL;
    int tail = q + 1 - complete * POOL;
    pairs += tail < POOL - 1 ? tail : POOL - 1;
  }
  printf("| form | keys | accumulator MiB | ms | ratio to v4.f32 | reductions (G) | GB added |\n");
  printf("|---|---|---|---|---|---|---|\n");
  // all keys (the accumulator as large as the backward's), then keys folded into 4096 rows
  // (an L2-resident accumulator: the reduction units without HBM)
  for (int fold = 0; fold < 2; ++fold) {
    int keys = fold ? 4096 : seq;
    int mask = fold ? 4095 : 0x7fffffff;
    float base = 0;
    for (int f = 0; f < NFORMS; ++f) {
      size_t bytes = (size_t)keys * D * bytes_per_value[f];
      float ms = 0;
      switch (f) {
        case V4F32: ms = run<V4F32>(acc, bytes, seq, mask, reps); break;
        case V2F32: ms = run<V2F32>(acc, bytes, seq, mask, reps); break;
        case F32: ms = run<F32>(acc, bytes, seq, mask, reps); break;
        case U64_PACKED: ms = run<U64_PACKED>(acc, bytes, seq, mask, reps); break;
        case U64_ONE: ms = run<U64_ONE>(acc, bytes, seq, mask, reps); break;
        case ST_V4: ms = run<ST_V4>(acc, bytes, seq, mask, reps); break;
        case V4_TILE: ms = run<V4_TILE>(acc, bytes, seq, mask, reps); break;
        case V4_TILE4: ms = run<V4_TILE4>(acc, bytes, seq, mask, reps); break;
        case V4_TILE2: ms = run<V4_TILE2>(acc, bytes, seq, mask, reps); break;
        case V4_TILE4X: ms = run<V4_TILE4X>(acc, bytes, seq, mask, reps); break;
      }
      if (f == 0) base = ms;
      double ops = pairs * D / values_per_op[f];
      printf("| %s | %d | %.0f | %.2f | %.3f | %.2f | %.1f |\n", names[f], keys, bytes / 1048576.0,
             ms, ms / base, ops / 1e9, pairs * D * bytes_per_value[f] / 1e9);
      fflush(stdout);
    }
  }
  // the default form with part of the accumulator kept in L2 (an access policy window on the
  // stream, persisting hits, streaming misses): what L2 residency of dKV could gain at most
  {
    size_t bytes = (size_t)seq * D * 4;
    size_t setaside = prop.persistingL2CacheMaxSize;
    CHECK(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, setaside));
    cudaStream_t st;
    CHECK(cudaStreamCreate(&st));
    size_t win = bytes < (size_t)prop.accessPolicyMaxWindowSize ? bytes : prop.accessPolicyMaxWindowSize;
    float base = run<V4F32>(acc, bytes, seq, 0x7fffffff, reps, st);
    printf("\n| v4.f32, persisting L2 window (set-aside %zu MiB, window %zu MiB) | hit ratio | ms | ratio to none |\n",
           setaside >> 20, win >> 20);
    printf("|---|---|---|---|\n| none | - | %.2f | 1.000 |\n", base);
    for (float hr : {0.25f, 0.5f, (float)setaside / win, 1.0f}) {
      if (hr > 1.0f) hr = 1.0f;
      cudaStreamAttrValue attr = {};
      attr.accessPolicyWindow.base_ptr = acc;
      attr.accessPolicyWindow.num_bytes = win;
      attr.accessPolicyWindow.hitRatio = hr;
      attr.accessPolicyWindow.hitProp = cudaAccessPropertyPersisting;
      attr.accessPolicyWindow.missProp = cudaAccessPropertyStreaming;
      CHECK(cudaStreamSetAttribute(st, cudaStreamAttributeAccessPolicyWindow, &attr));
      float ms = run<V4F32>(acc, bytes, seq, 0x7fffffff, reps, st);
      printf("| window | %.2f | %.2f | %.3f |\n", hr, ms, ms / base);
      fflush(stdout);
      attr.accessPolicyWindow.num_bytes = 0;
      CHECK(cudaStreamSetAttribute(st, cudaStreamAttributeAccessPolicyWindow, &attr));
      CHECK(cudaCtxResetPersistingL2Cache());
    }
    CHECK(cudaStreamDestroy(st));
  }
  // the default form and the kernel's (4 rows x 128 B after the exchange) with an L2 cache
  // policy on each add (no set-aside, the full accumulator)
  {
    size_t bytes = (size_t)seq * D * 4;
    const int m = 0x7fffffff;
    printf("\n| L2 cache policy on the adds (createpolicy, no set-aside) | v4.f32 ms | ratio | 4 rows x 128 B after the exchange ms | ratio |\n");
    printf("|---|---|---|---|---|\n");
    float b0 = 0, b1 = 0;
    for (int p = 0; p < NPOL; ++p) {
      float m0 = 0, m1 = 0;
      switch (p) {
        case 0: m0 = run<V4F32, 0>(acc, bytes, seq, m, reps); m1 = run<V4_TILE4X, 0>(acc, bytes, seq, m, reps); break;
        case 1: m0 = run<V4F32, 1>(acc, bytes, seq, m, reps); m1 = run<V4_TILE4X, 1>(acc, bytes, seq, m, reps); break;
        case 2: m0 = run<V4F32, 2>(acc, bytes, seq, m, reps); m1 = run<V4_TILE4X, 2>(acc, bytes, seq, m, reps); break;
        case 3: m0 = run<V4F32, 3>(acc, bytes, seq, m, reps); m1 = run<V4_TILE4X, 3>(acc, bytes, seq, m, reps); break;
        case 4: m0 = run<V4F32, 4>(acc, bytes, seq, m, reps); m1 = run<V4_TILE4X, 4>(acc, bytes, seq, m, reps); break;
        case 5: m0 = run<V4F32, 5>(acc, bytes, seq, m, reps); m1 = run<V4_TILE4X, 5>(acc, bytes, seq, m, reps); break;
        case 6: m0 = run<V4F32, 6>(acc, bytes, seq, m, reps); m1 = run<V4_TILE4X, 6>(acc, bytes, seq, m, reps); break;
        case 7: m0 = run<V4F32, 7>(acc, bytes, seq, m, reps); m1 = run<V4_TILE4X, 7>(acc, bytes, seq, m, reps); break;
        case 8: m0 = run<V4F32, 8>(acc, bytes, seq, m, reps); m1 = run<V4_TILE4X, 8>(acc, bytes, seq, m, reps); break;
      }
      if (p == 0) b0 = m0, b1 = m1;
      printf("| %s | %.2f | %.3f | %.2f | %.3f |\n", pol_names[p], m0, m0 / b0, m1, m1 / b1);
      fflush(stdout);
    }
  }
  // the packed form's arithmetic: lanes that wrap in between but end in range come back exact
  {
    const int n = 4096;
    uint64_t *a2;
    int64_t *elo, *ehi;
    int *bad;
    CHECK(cudaMalloc(&a2, n * 8));
    CHECK(cudaMalloc(&elo, n * 8));
    CHECK(cudaMalloc(&ehi, n * 8));
    CHECK(cudaMallocManaged(&bad, 4));
    int64_t *hlo = (int64_t *)malloc(n * 8), *hhi = (int64_t *)malloc(n * 8);
    uint64_t *hacc = (uint64_t *)calloc(n, 8);
    srand(1);
    for (int i = 0; i < n; ++i) {
      hlo[i] = hhi[i] = 0;
      for (int k = 0; k < 64; ++k) {  // 64 terms of up to 2^26 each: partial sums stay in range
        int32_t lo = (rand() % (1 << 27)) - (1 << 26), hi = (rand() % (1 << 27)) - (1 << 26);
        hlo[i] += lo;
        hhi[i] += hi;
        hacc[i] += ((uint64_t)(int64_t)hi << 32) + (uint64_t)(int64_t)lo;
      }
    }
    CHECK(cudaMemcpy(a2, hacc, n * 8, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(elo, hlo, n * 8, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(ehi, hhi, n * 8, cudaMemcpyHostToDevice));
    *bad = 0;
    unpack_check<<<n / 256, 256>>>(a2, elo, ehi, n, bad);
    CHECK(cudaDeviceSynchronize());
    printf("\npacked-lane unpack check: %d of %d wrong\n", *bad, n);
    if (*bad) return 1;
  }
  return 0;
}
