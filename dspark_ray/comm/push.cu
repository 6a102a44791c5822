// NVLink one-shot push collectives between the two ranks of a pair (CUDA IPC peer memory).
//
// Each rank owns one "state" allocation (plain cudaMalloc, exported over CUDA IPC). The peer writes into it:
// payload into the receive buffers, flags, consumption acks and mirrored error bits. A rank only ever *reads* its
// own state and *writes* the peer's (plus its own control words), so every wait is a local poll.
//
// Protocol of one collective at epoch e (both ranks issue the same sequence of collectives):
//  * e = (own epoch counter) + 1, read at kernel start; the last block to finish publishes e back, so CUDA graph
//    replays advance epochs with no host involvement. e == 0 (uint32 exhausted) is never published: the launch
//    fails closed with ERR_EXHAUSTED before any peer payload access (a zero-initialised flag must never match).
//  * A sticky error word: if it is non-zero at kernel start, the launch touches nothing of the peer's.
//  * Double buffering by parity p = e & 1, plus per-block consumption acks: before writing parity p again, every
//    block of the launch waits until the peer has acked *all* blocks of the last launch that used parity p
//    (epoch e - 2; their count is recorded in last_nblk[p], so launches of different block counts mix safely).
//  * Push: vector stores into the peer's receive buffer through the IPC-opened pointer (UVA over NVLink), then a
//    per-block flag with st.release.sys carrying (shape, e); the consumer waits with ld.acquire.sys on its own flag.
//    A flag of the right epoch but another shape (the ranks disagree on the collective) fails closed (ERR_LAYOUT).
//  * Every wait is bounded by %globaltimer (timeout_ns, measured from this block's start against the local timer
//    only) and polls the error word, so a peer's error, a mirrored timeout or a cancel unblocks it at once.
//  * Errors are OR-ed into the own error word and mirrored into the peer's (a local timeout shows there as a peer
//    timeout). A failed block writes NaN (ids -1) into its part of the output; the host refuses the output anyway.
//
// The layout constants (offsets, MAXB, MAXX, RECV4) are prepended by dspark_ray/comm/source.py from
// peer_state.Layout; the defaults below only serve a standalone `nvcc -c` syntax check.

#ifndef PUSH_MAXB
#define PUSH_MAXB 128
#define PUSH_MAXX 128
#define PUSH_RECV4 163840
#define OFF_EPOCH 0
#define OFF_DONE 4
#define OFF_LASTN 8
#define OFF_ERR 16
#define OFF_ERR_EPOCH 20
#define OFF_HELLO 24
#define OFF_DBG_SKIP 32
#define OFF_FLAGS 256
#define OFF_ACKS 2304
#define OFF_XRECV 4096
#define OFF_RECV 12288
#endif

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned char u8;

#define ERR_LOCAL_TIMEOUT 1u
#define ERR_PEER_TIMEOUT 2u
#define ERR_BAD_ID 4u
#define ERR_CANCELLED 8u
#define ERR_EXHAUSTED 16u
#define ERR_LAYOUT 32u

#define KIND_AR 1u
#define KIND_MAX 2u
#define KIND_TOP2 3u
#define KIND_AR_LAMPORT 4u

// Lamport variant: an empty receive word holds a signaling NaN. No fp32 arithmetic ever produces a signaling NaN,
// so a computed partial never equals it; a raw input that does is sent as its quiet twin (what the add would turn
// it into anyway).
#define LAMPORT_EMPTY 0xFFBFFFFFu
#define LAMPORT_EMPTY_QUIET 0xFFFFFFFFu
#define CANONICAL_NAN 0x7FFFFFFFu

// Consumption acks: st.relaxed.sys by default (1), st.release.sys with PUSH_ACK_RELAXED=0. The release costs a
// system-scope fence per block (~1 us per collective, measured) and orders nothing that needs ordering: an ack is
// stored after __syncthreads, and every load it acknowledges has already returned its value (the adds consumed
// it), so a later write of the peer cannot change what was read. Reuse is also ordered by the stream: the peer
// cannot write parity p again (epoch e + 2) before it has our epoch e + 1 payload, which we push only after
// epoch e completed. The ack is the explicit check of that.
#ifndef PUSH_ACK_RELAXED
#define PUSH_ACK_RELAXED 1
#endif

// ---------------------------------------------------------------------------------------------------------------
// memory-model helpers

__device__ __forceinline__ u64 gtimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ u32 ld_acquire_u32(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u64 ld_acquire_u64(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u32 ld_relaxed_u32(const u32* p) {
  u32 v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_u32(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_u32(u32* p, u32 v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_u64(u64* p, u64 v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_release_u64(u64* p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ float4 ld_volatile_f4(const float4* p) {
  float4 v;
  asm volatile("ld.volatile.global.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_volatile_f4(float4* p, float4 v) {
  asm volatile("st.volatile.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z),
               "f"(v.w) : "memory");
}
__device__ __forceinline__ float ld_volatile_f32(const float* p) {
  float v;
  asm volatile("ld.volatile.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_volatile_f32(float* p, float v) {
  asm volatile("st.volatile.global.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}
__device__ __forceinline__ void st_volatile_u64x2(u64* p, u64 a, u64 b) {
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}
__device__ __forceinline__ void ld_volatile_u64x2(const u64* p, u64& a, u64& b) {
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}

__device__ __forceinline__ u32* ctl(u8* base, int off) { return (u32*)(base + off); }
__device__ __forceinline__ u64* flag_at(u8* base, u32 p, u32 b) {
  return (u64*)(base + OFF_FLAGS) + (size_t)p * PUSH_MAXB + b;
}
__device__ __forceinline__ u32* ack_at(u8* base, u32 p, u32 b) {
  return (u32*)(base + OFF_ACKS) + (size_t)p * PUSH_MAXB + b;
}
__device__ __forceinline__ float4* recv_at(u8* base, u32 p) {
  return (float4*)(base + OFF_RECV) + (size_t)p * PUSH_RECV4;
}
__device__ __forceinline__ u64* xrecv_at(u8* base, u32 p, int row) {
  return (u64*)(base + OFF_XRECV) + ((size_t)p * PUSH_MAXX + row) * 4;
}

// Record an error: OR into the own word (first failing epoch kept), mirror into the peer's. A local timeout is a
// peer timeout from the peer's point of view; every other bit is mirrored as is.
__device__ void raise_error(u8* my, u8* peer, u32 bits, u32 e) {
  u32 old = atomicOr_system(ctl(my, OFF_ERR), bits);
  if (old == 0u) atomicCAS_system(ctl(my, OFF_ERR_EPOCH), 0u, e);
  if (peer) {
    u32 mirrored = (bits & ~ERR_LOCAL_TIMEOUT) | ((bits & ERR_LOCAL_TIMEOUT) ? ERR_PEER_TIMEOUT : 0u);
    atomicOr_system(ctl(peer, OFF_ERR), mirrored);
  }
}

// Bounded wait on one of the own flags. Returns 1 once it holds `want`, 0 on failure (error raised or seen).
// The error word and the timer are read every 16th poll only, so the poll itself stays one load.
__device__ int wait_flag(u8* my, u8* peer, const u64* f, u64 want, u32 e, u64 t0, u64 timeout_ns) {
  for (u32 spins = 1;; ++spins) {
    u64 v = ld_acquire_u64(f);
    if ((u32)v == (u32)want) {
      if (v == want) return 1;
      raise_error(my, peer, ERR_LAYOUT, e);  // same epoch, different collective: the ranks disagree
      return 0;
    }
    if ((spins & 15u) == 0u) {
      if (ld_relaxed_u32(ctl(my, OFF_ERR))) return 0;
      if (gtimer() - t0 > timeout_ns) {
        raise_error(my, peer, ERR_LOCAL_TIMEOUT, e);
        return 0;
      }
    }
  }
}

// The Lamport header: like wait_flag, but with relaxed polls (it publishes nothing; the data words carry their own
// arrival).
__device__ int wait_header(u8* my, u8* peer, const u64* f, u64 want, u32 e, u64 t0, u64 timeout_ns) {
  for (u32 spins = 1;; ++spins) {
    u64 v = *(volatile const u64*)f;
    if ((u32)v == (u32)want) {
      if (v == want) return 1;
      raise_error(my, peer, ERR_LAYOUT, e);
      return 0;
    }
    if ((spins & 15u) == 0u) {
      if (ld_relaxed_u32(ctl(my, OFF_ERR))) return 0;
      if (gtimer() - t0 > timeout_ns) {
        raise_error(my, peer, ERR_LOCAL_TIMEOUT, e);
        return 0;
      }
    }
  }
}

// Bounded wait until one of the own ack words holds epoch `want` or later. "Or later" matters: the ack slots of a
// parity serve epochs e-2 and e, and a peer block with nothing to consume (or one that got its flag early) may ack
// epoch e before another block of this launch has checked e-2. Epochs never wrap (exhaustion fails closed), so
// the unsigned comparison is exact; an ack can never run ahead of e (the peer cannot consume e+2 before we push it).
__device__ int wait_ack(u8* my, u8* peer, const u32* a, u32 want, u32 e, u64 t0, u64 timeout_ns) {
  for (u32 spins = 1; ld_acquire_u32(a) < want; ++spins) {
    if ((spins & 15u) == 0u) {
      if (ld_relaxed_u32(ctl(my, OFF_ERR))) return 0;
      if (gtimer() - t0 > timeout_ns) {
        raise_error(my, peer, ERR_LOCAL_TIMEOUT, e);
        return 0;
      }
    }
  }
  return 1;
}

// Kernel prologue, all threads of the block. Returns true when the block may go on; e and t0 are always set.
// Every thread reads the control words itself (one 32-byte sector: one L2 transaction per warp), which saves a
// barrier. The epoch and last_nblk cannot change during the launch (only the last block to finish writes them);
// the error word can (a mirrored error, a cancel), so threads may disagree about it, and the final
// __syncthreads_and makes the block refuse if any thread saw it set.
__device__ __forceinline__ bool begin(u8* my, u8* peer, u64 timeout_ns, u32& e_out, u64& t0_out) {
  const u32 ctr = *(volatile u32*)ctl(my, OFF_EPOCH);
  const u32 err = ld_relaxed_u32(ctl(my, OFF_ERR));
  const u32 last0 = *(volatile u32*)ctl(my, OFF_LASTN), last1 = *(volatile u32*)ctl(my, OFF_LASTN + 4);
  const u32 e = ctr + 1u;
  const u64 t0 = gtimer();
  e_out = e;
  t0_out = t0;
  if (e == 0u) {                                                        // epoch 0 is never published
    if (blockIdx.x == 0 && threadIdx.x == 0 && err == 0u) raise_error(my, peer, ERR_EXHAUSTED, 0u);
    return false;                                                        // uniform: every thread sees e == 0
  }
  int ok = err == 0u;                                                    // sticky: refuse, touch nothing of the peer's
  // Before this parity's buffers are written again: the peer must have acked every block of the last launch that
  // used them (epoch e - 2). Threads check the acks in parallel; normally they arrived long ago (one local read).
  const u32 p = e & 1u;
  const u32 nprev = p ? last1 : last0;
  for (u32 j = threadIdx.x; j < nprev && ok; j += blockDim.x)
    ok = wait_ack(my, peer, ack_at(my, p, j), e - 2u, e, t0, timeout_ns);
  return __syncthreads_and(ok) != 0;
}

// Kernel epilogue (thread 0 of each block): the last block to finish publishes the epoch (not after exhaustion:
// it stays exhausted) and records how many blocks used this parity, for the next launch's ack check. No fence is
// needed: every block has read the epoch before it counts itself done, and the next launch on this stream sees
// these stores after the kernel boundary. A one-block launch skips the counter.
__device__ __forceinline__ void finish(u8* my, u32 e) {
  if (threadIdx.x != 0) return;
  if (gridDim.x > 1u) {
    u32* done = ctl(my, OFF_DONE);
    if (atomicAdd(done, 1u) != gridDim.x - 1u) return;
    *(volatile u32*)done = 0u;
  }
  if (e != 0u) {
    *(volatile u32*)ctl(my, OFF_LASTN + 4 * (int)(e & 1u)) = gridDim.x;
    *(volatile u32*)ctl(my, OFF_EPOCH) = e;
  }
}

// After __syncthreads (every read of this block's part of the receive buffer is done): ack it to the peer.
// strict: then also wait until the peer has acked *our* payload of this epoch before the block completes (seed
// 000's RX-TP2SAFE order: an error the peer raised while consuming, e.g. a refused id, is in our error word before
// our kernel ends). Costs one more one-way trip; off by default (the deferred check before reuse keeps the buffers
// safe, and the pair's STEP check reads both ranks' error words). Returns false when the strict wait failed.
__device__ __forceinline__ bool ack_peer(u8* my, u8* peer, u32 e, int strict, u64 t0, u64 timeout_ns) {
  __shared__ int s_acked;
  if (threadIdx.x == 0) {
#if PUSH_ACK_RELAXED
    st_relaxed_u32(ack_at(peer, e & 1u, blockIdx.x), e);   // the reads it acks have returned their values
#else
    st_release_u32(ack_at(peer, e & 1u, blockIdx.x), e);
#endif
    s_acked = strict ? wait_ack(my, peer, ack_at(my, e & 1u, blockIdx.x), e, e, t0, timeout_ns) : 1;
  }
  if (!strict) return true;
  __syncthreads();
  return s_acked != 0;
}

__device__ __forceinline__ u64 shape_word(u32 kind, u32 nblk, u32 n) {
  return (u64)((kind << 28) | ((nblk & 0xFFu) << 20) | (n & 0xFFFFFu)) << 32;
}

// P0 + P1 in rank order, computed exactly as torch computes `P0 + P1` on the GPU: ufunc::add is
// self + alpha * other, one FFMA with alpha a run-time 1.0f (`one`, a kernel argument, so the compiler cannot turn
// it into an FADD). For numbers this is the plain fp32 sum; it also gives NaN + NaN torch's NaN payload (measured
// on the H200: FADD and FFMA pick different payloads).
// NaN + NaN: which payload the result carries is the hardware's choice and differs between instructions (measured:
// neither FADD nor this FFMA matched torch for one NaN pair). `nan_rule` is what torch's own add returned on this
// GPU at start-up (push.torch_nan_rule), two bits per (P0 signaling?, P1 signaling?) case: 0 keep the FFMA's
// result, 1 quiet(P0), 2 quiet(P1), 3 canonical NaN. Taken only when both inputs are NaN.
__device__ __forceinline__ float add1(float p0, float p1, float one, u32 nan_rule) {
  float r = __fmaf_rn(one, p1, p0);
  if (p0 != p0 && p1 != p1) {
    const u32 a = __float_as_uint(p0), b = __float_as_uint(p1);
    const u32 t = ((a & 0x00400000u) ? 0u : 2u) | ((b & 0x00400000u) ? 0u : 1u);
    const u32 code = (nan_rule >> (2u * t)) & 3u;
    if (code == 1u) r = __uint_as_float(a | 0x00400000u);
    else if (code == 2u) r = __uint_as_float(b | 0x00400000u);
    else if (code == 3u) r = __uint_as_float(CANONICAL_NAN);
  }
  return r;
}
__device__ __forceinline__ float4 add_rank_order(float4 mine, float4 theirs, int rank, float one, u32 nr) {
  float4 a = rank == 0 ? mine : theirs, b = rank == 0 ? theirs : mine;
  return make_float4(add1(a.x, b.x, one, nr), add1(a.y, b.y, one, nr), add1(a.z, b.z, one, nr),
                     add1(a.w, b.w, one, nr));
}
__device__ __forceinline__ float add_rank_order1(float mine, float theirs, int rank, float one, u32 nr) {
  return rank == 0 ? add1(mine, theirs, one, nr) : add1(theirs, mine, one, nr);
}

// Block b of nb owns float4s [beg, end); the last block also owns the scalar tail (n % 4 words).
struct Part {
  int beg, end, tail_beg, tail_end;
};
__device__ __forceinline__ Part part_of(int n) {
  const int n4 = n >> 2, nb = gridDim.x, b = blockIdx.x;
  const int chunk = (n4 + nb - 1) / nb;
  Part r;
  r.beg = min(n4, b * chunk);
  r.end = min(n4, r.beg + chunk);
  r.tail_beg = (b == nb - 1) ? (n4 << 2) : n;
  r.tail_end = n;
  return r;
}

__device__ __forceinline__ void fill_nan(float* out, Part q) {
  const float qnan = __uint_as_float(CANONICAL_NAN);
  float4* o4 = (float4*)out;
  for (int i = q.beg + threadIdx.x; i < q.end; i += blockDim.x) o4[i] = make_float4(qnan, qnan, qnan, qnan);
  for (int i = q.tail_beg + threadIdx.x; i < q.tail_end; i += blockDim.x) out[i] = qnan;
}

// ---------------------------------------------------------------------------------------------------------------
// all-reduce, flag protocol (the default): out = P0 + P1 in fp32, identical bits on both ranks.
// n < 0: preload launch (returns at once). dbg_skip_block: a block index whose flag is never raised (tests only);
// -1 defers to the device word OFF_DBG_SKIP (block + 1, 0 = none), which graph replays read too (fault injection).

__device__ __forceinline__ int skip_block(const u8* my, int dbg_skip_block) {
  return dbg_skip_block >= 0 ? dbg_skip_block : (int)(*(volatile const u32*)(my + OFF_DBG_SKIP)) - 1;
}


extern "C" __global__ void __launch_bounds__(1024)
push_all_reduce(const float* __restrict__ x, float* __restrict__ out, int n, int rank, u8* my, u8* peer,
                u64 timeout_ns, int dbg_skip_block, int strict, float one, u32 nan_rule) {
  if (n < 0) return;
  const int skip = skip_block(my, dbg_skip_block);
  u32 e;
  u64 t0;
  bool ok = begin(my, peer, timeout_ns, e, t0);
  const Part q = part_of(n);
  const u32 p = e & 1u;
  const float4* x4 = (const float4*)x;
  if (ok) {
    float4* pr = recv_at(peer, p);
    for (int i = q.beg + threadIdx.x; i < q.end; i += blockDim.x) pr[i] = x4[i];
    for (int i = q.tail_beg + threadIdx.x; i < q.tail_end; i += blockDim.x) ((float*)pr)[i] = x[i];
    __syncthreads();
    __shared__ int s_ok;
    if (threadIdx.x == 0) {
      const u64 want = shape_word(KIND_AR, gridDim.x, (u32)n) | e;
      if ((int)blockIdx.x != skip) st_release_u64(flag_at(peer, p, blockIdx.x), want);
      s_ok = wait_flag(my, peer, flag_at(my, p, blockIdx.x), want, e, t0, timeout_ns);
    }
    __syncthreads();
    ok = s_ok != 0;
  }
  if (ok) {
    const float4* mr = recv_at(my, p);
    float4* o4 = (float4*)out;
    for (int i = q.beg + threadIdx.x; i < q.end; i += blockDim.x) o4[i] = add_rank_order(x4[i], __ldcv(mr + i), rank, one, nan_rule);
    for (int i = q.tail_beg + threadIdx.x; i < q.tail_end; i += blockDim.x)
      out[i] = add_rank_order1(x[i], __ldcv((const float*)mr + i), rank, one, nan_rule);
    __syncthreads();
    ack_peer(my, peer, e, strict, t0, timeout_ns);
  } else {
    fill_nan(out, q);
  }
  finish(my, e);
}

// ---------------------------------------------------------------------------------------------------------------
// all-reduce, Lamport variant: the payload marks its own arrival. The receive buffer holds LAMPORT_EMPTY between
// uses; the consumer polls its words until none is empty, adds, and writes EMPTY back. No flag round trip: the
// producer's stores are not fenced. Each block also stores a header word (shape << 32 | epoch, relaxed, in its
// flag slot) that the consumer's thread 0 checks, so a peer at another epoch or running another collective (other
// length, block count or variant) fails closed with ERR_LAYOUT instead of being summed.

__device__ __forceinline__ float sanitize(float v) {
  return __float_as_uint(v) == LAMPORT_EMPTY ? __uint_as_float(LAMPORT_EMPTY_QUIET) : v;
}
__device__ __forceinline__ bool has_empty(float4 v) {
  return __float_as_uint(v.x) == LAMPORT_EMPTY || __float_as_uint(v.y) == LAMPORT_EMPTY ||
         __float_as_uint(v.z) == LAMPORT_EMPTY || __float_as_uint(v.w) == LAMPORT_EMPTY;
}

extern "C" __global__ void __launch_bounds__(1024)
push_all_reduce_lamport(const float* __restrict__ x, float* __restrict__ out, int n, int rank, u8* my, u8* peer,
                        u64 timeout_ns, int dbg_skip_block, int strict, float one, u32 nan_rule) {
  if (n < 0) return;
  const int skip = skip_block(my, dbg_skip_block);
  u32 e;
  u64 t0;
  bool ok = begin(my, peer, timeout_ns, e, t0);
  const Part q = part_of(n);
  const u32 p = e & 1u;
  const float4* x4 = (const float4*)x;
  if (ok) {
    float4* pr = recv_at(peer, p);
    const u64 header = shape_word(KIND_AR_LAMPORT, gridDim.x, n) | e;
    if ((int)blockIdx.x != skip) {
      if (threadIdx.x == 0) st_relaxed_u64(flag_at(peer, p, blockIdx.x), header);   // first: it arrives first
      for (int i = q.beg + threadIdx.x; i < q.end; i += blockDim.x) {
        float4 v = x4[i];
        st_volatile_f4(pr + i, make_float4(sanitize(v.x), sanitize(v.y), sanitize(v.z), sanitize(v.w)));
      }
      for (int i = q.tail_beg + threadIdx.x; i < q.tail_end; i += blockDim.x)
        st_volatile_f32((float*)pr + i, sanitize(x[i]));
    }
    float4* mr = recv_at(my, p);
    float4* o4 = (float4*)out;
    const float4 empty4 = make_float4(__uint_as_float(LAMPORT_EMPTY), __uint_as_float(LAMPORT_EMPTY),
                                      __uint_as_float(LAMPORT_EMPTY), __uint_as_float(LAMPORT_EMPTY));
    int fail = 0;
    if (threadIdx.x == 0)   // the header: same epoch, same collective (no order against the data is needed)
      fail = !wait_header(my, peer, flag_at(my, p, blockIdx.x), header, e, t0, timeout_ns);
    for (int i = q.beg + threadIdx.x; i < q.end && !fail; i += blockDim.x) {
      float4 r = ld_volatile_f4(mr + i);
      u32 spins = 0;
      while (has_empty(r)) {
        if ((++spins & 31u) == 0u) {
          if (ld_relaxed_u32(ctl(my, OFF_ERR))) { fail = 1; break; }
          if (gtimer() - t0 > timeout_ns) { raise_error(my, peer, ERR_LOCAL_TIMEOUT, e); fail = 1; break; }
        }
        r = ld_volatile_f4(mr + i);
      }
      if (fail) break;
      o4[i] = add_rank_order(x4[i], r, rank, one, nan_rule);
      st_volatile_f4(mr + i, empty4);
    }
    for (int i = q.tail_beg + threadIdx.x; i < q.tail_end && !fail; i += blockDim.x) {
      float r = ld_volatile_f32((const float*)mr + i);
      u32 spins = 0;
      while (__float_as_uint(r) == LAMPORT_EMPTY) {
        if ((++spins & 31u) == 0u) {
          if (ld_relaxed_u32(ctl(my, OFF_ERR))) { fail = 1; break; }
          if (gtimer() - t0 > timeout_ns) { raise_error(my, peer, ERR_LOCAL_TIMEOUT, e); fail = 1; break; }
        }
        r = ld_volatile_f32((const float*)mr + i);
      }
      if (fail) break;
      out[i] = add_rank_order1(x[i], r, rank, one, nan_rule);
      st_volatile_f32((float*)mr + i, __uint_as_float(LAMPORT_EMPTY));
    }
    ok = __syncthreads_or(fail) == 0;
    if (ok) ack_peer(my, peer, e, strict, t0, timeout_ns);
  }
  if (!ok) fill_nan(out, q);
  finish(my, e);
}

// ---------------------------------------------------------------------------------------------------------------
// (max, index) and (top1, top2, index) exchange: one block, one thread per row (n <= MAXX).
// Each row travels as 64-bit words (value bits | epoch << 32): an aligned 64-bit word arrives whole, so a word
// whose tag equals the epoch is this launch's payload ("tagged", the default: no separate flag round trip).
// use_flag = 1 adds a per-block flag (st.release.sys / ld.acquire.sys) before the words are read.
// Received ids must lie in [peer_lo, peer_hi) (the peer's vocabulary slice), else ERR_BAD_ID (mirrored).
// Combine (rank 0's part a, rank 1's part b), exactly collectives.combine_max / combine_top2: b wins only if
// strictly larger (ties to the lower id = rank 0) or if a is NaN and b is not (a NaN never beats a number; both
// NaN keep rank 0); top2 = b wins ? max(a1, b2) : max(a2, b1), max propagating NaN like torch.maximum.

__device__ __forceinline__ float max_nan(float a, float b) { return a != a ? a : (b != b ? b : fmaxf(a, b)); }

extern "C" __global__ void __launch_bounds__(128)
push_exchange(const float* __restrict__ v1, const float* __restrict__ v2, const i64* __restrict__ idx,
              float* __restrict__ o1, float* __restrict__ o2, i64* __restrict__ oidx, int n, int rank, int top2,
              int use_flag, u8* my, u8* peer, u64 timeout_ns, i64 peer_lo, i64 peer_hi, int strict) {
  if (n < 0) return;
  u32 e;
  u64 t0;
  bool ok = begin(my, peer, timeout_ns, e, t0);
  const u32 p = e & 1u;
  const int i = threadIdx.x;
  const bool row = i < n;
  float a1 = 0.f, a2 = 0.f;
  i64 ai = 0;
  if (row) {
    a1 = v1[i];
    if (top2) a2 = v2[i];
    ai = idx[i];
  }
  const u64 tag = (u64)e << 32;
  int fail = 0;
  float b1 = 0.f, b2 = 0.f;
  i64 bi = 0;
  if (ok) {
    if (row) {
      const u32 iw = (ai >= 0 && ai <= (i64)0xFFFFFFFE) ? (u32)ai : 0xFFFFFFFFu;  // out of range: peer refuses
      u64* dst = xrecv_at(peer, p, i);
      st_volatile_u64x2(dst, tag | __float_as_uint(a1), tag | iw);
      if (top2) st_volatile_u64x2(dst + 2, tag | __float_as_uint(a2), tag | KIND_TOP2);
    }
    if (use_flag) {
      __syncthreads();
      __shared__ int s_ok;
      if (threadIdx.x == 0) {
        const u64 want = shape_word(top2 ? KIND_TOP2 : KIND_MAX, 1u, (u32)n) | e;
        st_release_u64(flag_at(peer, p, 0), want);
        s_ok = wait_flag(my, peer, flag_at(my, p, 0), want, e, t0, timeout_ns);
      }
      __syncthreads();
      fail = s_ok ? 0 : 1;
    }
    if (row && !fail) {
      const u64* src = xrecv_at(my, p, i);
      u64 w0, w1, w2 = tag, w3 = tag;
      u32 spins = 0;
      while (true) {
        ld_volatile_u64x2(src, w0, w1);
        if (top2) ld_volatile_u64x2(src + 2, w2, w3);
        if ((w0 >> 32) == e && (w1 >> 32) == e && (w2 >> 32) == e && (w3 >> 32) == e) break;
        if (use_flag) { raise_error(my, peer, ERR_LAYOUT, e); fail = 1; break; }  // flag seen, words stale
        if ((++spins & 15u) == 0u) {
          if (ld_relaxed_u32(ctl(my, OFF_ERR))) { fail = 1; break; }
          if (gtimer() - t0 > timeout_ns) { raise_error(my, peer, ERR_LOCAL_TIMEOUT, e); fail = 1; break; }
        }
      }
      if (!fail) {
        b1 = __uint_as_float((u32)w0);
        bi = (i64)(u32)w1;
        b2 = __uint_as_float((u32)w2);
        if (bi < peer_lo || bi >= peer_hi) { raise_error(my, peer, ERR_BAD_ID, e); fail = 1; }
      }
    }
    ok = __syncthreads_or(fail) == 0;
  }
  if (row) {
    if (ok) {
      // rank order: A = rank 0's part, B = rank 1's part
      const float A1 = rank == 0 ? a1 : b1, B1 = rank == 0 ? b1 : a1;
      const float A2 = rank == 0 ? a2 : b2, B2 = rank == 0 ? b2 : a2;
      const i64 Ai = rank == 0 ? ai : bi, Bi = rank == 0 ? bi : ai;
      const bool take_b = (B1 > A1) || (A1 != A1 && B1 == B1);  // collectives.combine_max: NaN never beats a number
      o1[i] = take_b ? B1 : A1;
      oidx[i] = take_b ? Bi : Ai;
      if (top2) o2[i] = take_b ? max_nan(A1, B2) : max_nan(A2, B1);
    } else {
      const float qnan = __uint_as_float(CANONICAL_NAN);
      o1[i] = qnan;
      oidx[i] = -1;
      if (top2) o2[i] = qnan;
    }
  }
  if (ok) {
    __syncthreads();
    ack_peer(my, peer, e, strict, t0, timeout_ns);
  }
  finish(my, e);
}

// ---------------------------------------------------------------------------------------------------------------
// control kernels

// Cancel: launched on a pre-created independent stream; a parked collective sees the bit in its next poll.
extern "C" __global__ void push_cancel(u8* my, u8* peer) {
  if (my == 0) return;  // preload launch
  raise_error(my, peer, ERR_CANCELLED, 0u);
}

// Fill n words with v (the Lamport buffers' empty pattern at start-up and reset).
extern "C" __global__ void push_fill(u32* p, u32 v, u64 n) {
  if (p == 0) return;  // preload launch
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) p[i] = v;
}

// Start-up handshake: store a nonce into the peer's hello word through the IPC mapping (proves the stores reach
// the peer's card); the host then reads its own hello word.
extern "C" __global__ void push_hello(u8* my, u8* peer, u32 nonce) {
  if (my == 0 || peer == 0) return;  // preload launch
  st_release_u32(ctl(peer, OFF_HELLO), nonce);
}
