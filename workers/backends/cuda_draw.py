"""A batch's draw as one CUDA kernel: every row's filters (top_p, top_k, min_p), temperature and draw, or its argmax.

On a GPU a decode step of a small model is bound by the host launching kernels, not by the device running them. MLX's
draw for a batch with filtered rows (sampling.thresholds, then sampling.draw) launched ~30 kernels a step: a top-k,
a sort, cumulative sums, reductions and scatters; this is one, a block of threads per row.

It keeps sampling.draw's definitions: a row's filters act on its untempered log-probabilities and keep the top_k
likeliest, the fewest likeliest that make up top_p of the probability, those at least min_p times the likeliest (at
least one; a row with top_p or min_p but no top_k among the sampling.CANDIDATES likeliest); the draw inverts the
tempered distribution over the kept tokens, in token order, at the row's uniform; a greedy row takes its argmax. What
it does differently is how it finds the filters' cut: not by sorting, but by bisecting over the 32-bit keys that order
floats as their values do, counting the tokens above a key and summing their probability (32 passes over the row,
each a coalesced read the device does in microseconds). Sums are added in another order than MLX's, so a token whose
cumulative mass lands within a rounding error of a row's target can differ from the MLX draw's; each row's work is its
own, in a fixed order, so a seeded request draws the same alone as in any batch.

Checked against the MLX draw on a GPU by `bench/device/sampler_probe.py --check-draw` (the suite runs on CPUs).
"""

from __future__ import annotations

import mlx.core as mx

THREADS = 1024
"""Threads per row (CUDA's most a block): a row of 128k tokens is ~125 reads a thread per pass."""

HEADER = r"""
#define MLXQ_NEG_INF __int_as_float(0xff800000)

// The float's bits as an unsigned integer ordered as the floats are (a negative's bits flipped).
__device__ __forceinline__ unsigned int mlxq_key(float v) {
  const unsigned int b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// A float sum and a count over the block; every thread gets both (fs, cs: 33 slots of shared scratch).
__device__ void mlxq_block_sums(float& s, int& c, float* fs, int* cs) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
    c += __shfl_xor_sync(0xffffffffu, c, o);
  }
  __syncthreads();  // (the scratch's last readers are done)
  if (lane == 0) { fs[warp] = s; cs[warp] = c; }
  __syncthreads();
  if (warp == 0) {
    s = lane < warps ? fs[lane] : 0.0f;
    c = lane < warps ? cs[lane] : 0;
    for (int o = 16; o > 0; o >>= 1) {
      s += __shfl_xor_sync(0xffffffffu, s, o);
      c += __shfl_xor_sync(0xffffffffu, c, o);
    }
    if (lane == 0) { fs[32] = s; cs[32] = c; }
  }
  __syncthreads();
  s = fs[32];
  c = cs[32];
}

// The block's largest value and its first index; every thread gets both.
__device__ void mlxq_block_argmax(float& v, int& i, float* fs, int* cs) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
  }
  __syncthreads();
  if (lane == 0) { fs[warp] = v; cs[warp] = i; }
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? fs[lane] : MLXQ_NEG_INF;
    i = lane < warps ? cs[lane] : 0x7fffffff;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, i, o);
      if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
    if (lane == 0) { fs[32] = v; cs[32] = i; }
  }
  __syncthreads();
  v = fs[32];
  i = cs[32];
}

// Each thread's inclusive prefix sum of x, in thread order, into prefix[threadIdx.x] (fs: 33 slots of scratch).
__device__ void mlxq_block_scan(float x, float* prefix, float* fs) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int o = 1; o < 32; o <<= 1) {
    const float y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();
  if (lane == 31) fs[warp] = x;
  __syncthreads();
  if (warp == 0) {
    float w = lane < warps ? fs[lane] : 0.0f;
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    if (lane < warps) fs[lane] = w;
  }
  __syncthreads();
  prefix[threadIdx.x] = (warp > 0 ? fs[warp - 1] : 0.0f) + x;
  __syncthreads();
}
"""

SOURCE = r"""
  __shared__ float fs[33];
  __shared__ int cs[33];
  __shared__ float prefix[1024];
  __shared__ int chosen;
  const int row = blockIdx.x, tid = threadIdx.x, threads = blockDim.x;
  const int V = logprobs_shape[1];
  const T* x = logprobs + (size_t)row * V;

  // The likeliest token: a greedy row's answer, and the top every filter keeps.
  float best = MLXQ_NEG_INF;
  int best_i = 0x7fffffff;
  for (int i = tid; i < V; i += threads) {
    const float v = static_cast<float>(x[i]);
    if (v > best || best_i == 0x7fffffff) { best = v; best_i = i; }
  }
  mlxq_block_argmax(best, best_i, fs, cs);
  if (sampled[row] == 0.0f || !(best > MLXQ_NEG_INF)) {  // greedy, or nothing allowed (token 0, as MLX's draw gives)
    if (tid == 0) token[row] = best > MLXQ_NEG_INF ? best_i : 0;
    return;
  }

  // The filters' cut: the least key whose tokens above it are fewer than k and hold less than p of the probability.
  const int k = top_k[row];
  const float p = top_p[row], mp = min_p[row];
  const float floor_v = mp > 0.0f ? best + logf(mp) : MLXQ_NEG_INF;
  unsigned int floor_key = 0u;
  if (k < V || p < 1.0f) {
    unsigned int lo = 0u, hi = 0xffffffffu;
    while (lo < hi) {
      const unsigned int mid = lo + ((hi - lo) >> 1);
      float mass = 0.0f;
      int count = 0;
      for (int i = tid; i < V; i += threads) {
        const float v = static_cast<float>(x[i]);
        if (mlxq_key(v) > mid) { mass += expf(v); count += 1; }
      }
      mlxq_block_sums(mass, count, fs, cs);
      if (count < k && mass < p) hi = mid; else lo = mid + 1u;
    }
    floor_key = lo;
  }

  // The draw: each thread sums its run of tokens (in token order), a scan gives each run's place in the row's
  // cumulative mass, and the run holding the row's target walks to its token.
  const float inv = inverse[row], top = best * inv;
  const int per = (V + threads - 1) / threads;
  const int begin = min(tid * per, V), end = min(begin + per, V);
  float local = 0.0f;
  for (int i = begin; i < end; ++i) {
    const float v = static_cast<float>(x[i]);
    if (mlxq_key(v) >= floor_key && v >= floor_v) local += expf(v * inv - top);
  }
  if (tid == 0) chosen = 0x7fffffff;
  mlxq_block_scan(local, prefix, fs);
  const float target = uniform[row] * prefix[threads - 1];
  const float before = tid > 0 ? prefix[tid - 1] : 0.0f;
  if (local > 0.0f && prefix[tid] >= target && before < target) {
    float acc = before;
    int pick = -1;
    for (int i = begin; i < end; ++i) {
      const float v = static_cast<float>(x[i]);
      if (mlxq_key(v) >= floor_key && v >= floor_v) {
        acc += expf(v * inv - top);
        pick = i;
        if (acc >= target) break;
      }
    }
    atomicMin(&chosen, pick);  // (one run, unless rounding gives two: the first wins, the same every time)
  }
  __syncthreads();
  if (tid == 0) token[row] = chosen != 0x7fffffff ? chosen : best_i;
"""

_kernel = None


def available() -> bool:
    """Whether MLX computes on a CUDA GPU here (the kernel's only device)."""
    cuda = getattr(mx, "cuda", None)
    return mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()


def draw(logprobs: mx.array, inverse: mx.array, sampled: mx.array, uniform: mx.array, top_p: mx.array,
         top_k: mx.array, min_p: mx.array) -> mx.array:
    """(B,) uint32 tokens from (B, V) log-probabilities: per row its inverse temperature, whether it samples (else its
    argmax), its uniform, and its filters (top_p 1, top_k V and min_p 0: none; sampling.BatchSampler's `_arrays`)."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="mlxq_draw", input_names=["logprobs", "inverse", "sampled", "uniform", "top_p", "top_k", "min_p"],
            output_names=["token"], source=SOURCE, header=HEADER)
    rows = logprobs.shape[0]
    return _kernel(inputs=[logprobs, inverse, sampled, uniform, top_p, top_k, min_p], template=[("T", logprobs.dtype)],
                   grid=(rows * THREADS, 1, 1), threadgroup=(THREADS, 1, 1), output_shapes=[(rows,)],
                   output_dtypes=[mx.uint32])[0]
