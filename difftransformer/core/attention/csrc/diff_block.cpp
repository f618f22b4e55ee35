// The block method of differential attention as one fused CPU kernel (kernels.py, "block"): for each
// (batch, key/value group, query head, block of query rows) both maps' full score rows are computed by one batched
// product into a buffer that stays in cache, the kernel's own vectorised loops take each row's max, exp and sum and
// form P1 - lambda P2, and (P1 - lambda P2) V is one matrix product; the backward recomputes the rows and fuses the
// softmax backward of both maps, their row dots and the lambda gradient into one loop. The matrix products are
// ATen's (mm, addmm, baddbmm on views, no copies). Built from source at first use by cpu_kernel.py (with OpenMP, so
// that at::parallel_for runs on torch's threads: without -fopenmp it silently runs every task on one); without a
// compiler the same method runs in PyTorch operations.
//
// Threads: the tasks are (batch, key/value group), each split further when there are too few to keep every thread
// busy (splits_of); decoding takes one task per query row. Inside a task the matrix products run on one thread.
//
// Shapes (kernels.py): q (B, H, 2, Tq, d), k (B, Hkv, 2, Tk, d), v (B, Hkv, Tk, 2d), each with a unit stride in
// its last dimension; query head h reads group h / (H / Hkv). mask: empty, or boolean (B|1, Tq, Tk) contiguous,
// True where a query may attend. Causal: query i sees key j when j <= i + Tk - Tq. A row that may attend nothing
// gets zero probabilities (and output). The output A is returned token-major, (B, Tq, H, 2d), the layout in which
// the per-head norm and out_proj read it (no transposed copy); the backward takes its gradient in that layout.
//
// diff_decode: the same A for few query rows against a long cache without gradient (decoding), in one pass over the
// cache per query row (decode_impl below).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

namespace {

static_assert(sizeof(bool) == 1, "the mask is read as bytes (0 = may not attend)");

// exp(x) for x <= 0 in float, in a form the compiler vectorises: Cody-Waite reduction x = n ln2 + r,
// |r| <= ln2 / 2, and a degree-7 polynomial for exp(r) (about 1 ulp). Below -64 the result is 0: such a term,
// under 1.6e-28 of its row's largest (which is 1), changes no float32 sum, and dropping it keeps each probability
// (at least 1.6e-28 / T) and the products made from it out of the subnormal range, where x86 arithmetic is many
// times slower (a trained model's sharp rows are mostly such terms; clamped to exp(-87) they became subnormal
// once divided by the row's sum).
constexpr float kExpFloor = -64.0f;
inline float exp_nonpositive(float x) {
  const bool negligible = x < kExpFloor;
  x = negligible ? kExpFloor : x;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return negligible ? 0.0f : p * two_n;
}

inline double exp_nonpositive(double x) { return std::exp(x); }

// The largest of the first n entries of a row, masked ones skipped; lowest() when none is left. GCC vectorises a
// max reduction only when it may assume finite values: the attribute allows that here alone (scores are finite).
template <typename T, bool kMasked>
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("finite-math-only")))
#endif
T row_max(const T* s, int64_t n, const bool* allowed) {
  constexpr T kNone = std::numeric_limits<T>::lowest();
  T mx = kNone;
  for (int64_t j = 0; j < n; ++j) {
    const T x = kMasked && !allowed[j] ? kNone : s[j];
    mx = x > mx ? x : mx;
  }
  return mx;
}

// exp(s - max) of one score row in place over its first n entries (entries n..len-1 and masked ones become 0);
// returns 1 / sum, the row's normaliser, or 0 when the row may attend nothing (then it is all zeros).
template <typename T, bool kMasked>
T exp_row(T* s, int64_t n, int64_t len, const bool* allowed) {
  const T mx = row_max<T, kMasked>(s, n, allowed);
  if (mx == std::numeric_limits<T>::lowest()) {  // nothing to attend
    std::fill(s, s + len, T(0));
    return T(0);
  }
  T sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    const T e = exp_nonpositive(s[j] - mx);
    s[j] = kMasked && !allowed[j] ? T(0) : e;
    sum += s[j];
  }
  std::fill(s + n, s + len, T(0));
  return T(1) / sum;
}

struct Shapes {
  int64_t b, h, hkv, rep, tq, tk, d, dv, offset;
  bool causal;
};

Shapes shapes_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  return Shapes{q.size(0), q.size(1), k.size(1), q.size(1) / k.size(1), q.size(3), k.size(3), q.size(4), v.size(3),
                k.size(3) - q.size(3), causal};
}

// Every input as the loops read it, checked before any loop runs: CPU, one floating dtype (float32 or float64),
// the head layout, matching sizes (a v or grad_out of another length is refused, not cut), a dense last dimension
// (the products read rows through ATen; the mask and grad_out are read by pointer), a one-element lambda and a
// positive block.
void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lambda,
                  int64_t block, const at::Tensor* grad_out) {
  for (const at::Tensor* t : {&q, &k, &v, &lambda}) TORCH_CHECK(t->defined(), "diff_block: an input is undefined");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && lambda.device().is_cpu(),
              "diff_block: the fused kernel runs on CPU tensors only, got q on ", q.device(), ", k on ", k.device(),
              ", v on ", v.device(), ", lambda on ", lambda.device(), "; use impl 'sdpa' or 'block' elsewhere");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble,
              "diff_block: float32 or float64 inputs, got q of ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "diff_block: q, k and v must have one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), " and ",
              v.scalar_type());
  TORCH_CHECK(q.dim() == 5 && k.dim() == 5 && v.dim() == 4,
              "diff_block: q (B, H, 2, Tq, d) and k (B, Hkv, 2, Tk, d) must be 5-D and v (B, Hkv, Tk, dv) 4-D, got ",
              q.dim(), "-D, ", k.dim(), "-D and ", v.dim(), "-D");
  TORCH_CHECK(q.size(2) == 2 && k.size(2) == 2, "diff_block: q and k must hold two halves in dim 2, got ", q.size(2),
              " and ", k.size(2));
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "diff_block: the ", q.size(1),
              " query heads must be a multiple of the ", k.size(1), " key/value heads");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0), "diff_block: batch sizes differ: q ", q.size(0),
              ", k ", k.size(0), ", v ", v.size(0));
  TORCH_CHECK(v.size(1) == k.size(1), "diff_block: k has ", k.size(1), " heads, v ", v.size(1));
  TORCH_CHECK(k.size(4) == q.size(4), "diff_block: q and k head widths differ: ", q.size(4), " and ", k.size(4));
  TORCH_CHECK(v.size(2) == k.size(3), "diff_block: k holds ", k.size(3), " positions and v ", v.size(2),
              "; they must be equal");
  TORCH_CHECK(q.stride(4) == 1 && k.stride(4) == 1 && v.stride(3) == 1,
              "diff_block: the last dimension of q, k and v must be dense (stride 1): call .contiguous()");
  TORCH_CHECK(lambda.numel() == 1, "diff_block: lambda must hold one value, got ", lambda.numel());
  TORCH_CHECK(block > 0, "diff_block: block must be positive, got ", block);
  if (grad_out != nullptr) {
    TORCH_CHECK(grad_out->defined() && grad_out->device().is_cpu() && grad_out->scalar_type() == q.scalar_type(),
                "diff_block: grad_out must be a CPU tensor of q's dtype ", q.scalar_type());
    TORCH_CHECK(grad_out->dim() == 4 && grad_out->size(0) == q.size(0) && grad_out->size(1) == q.size(3) &&
                    grad_out->size(2) == q.size(1) && grad_out->size(3) == v.size(3),
                "diff_block: grad_out must be (B, Tq, H, dv) = (", q.size(0), ", ", q.size(3), ", ", q.size(1), ", ",
                v.size(3), "), got ", grad_out->sizes());
  }
}

// Keys query row i of a block may reach: all Tk, or up to i + offset under causality (at least none).
inline int64_t reach(const Shapes& s, int64_t i) {
  return s.causal ? std::max<int64_t>(0, std::min(s.tk, i + s.offset + 1)) : s.tk;
}

// Both maps' exp(score - row max) for query rows i0..i0+nb of one head into e (2, nb, kend), one batched product
// for both maps (qh: the head's (2, Tq, d) query halves, kg: its group's (2, Tk, d) key halves), and each row's
// normaliser 1 / sum into inv (2 x nb: map 1's rows, then map 2's); P_c = e_c * inv_c. mask_rows: the head's batch
// row of the mask, or null.
template <typename T>
void block_exps(const Shapes& s, const at::Tensor& qh, const at::Tensor& kg, const bool* mask_rows, double scale,
                int64_t i0, int64_t nb, int64_t kend, at::Tensor& e, T* inv) {
  at::baddbmm_out(e, e, qh.narrow(1, i0, nb), kg.narrow(1, 0, kend).transpose(1, 2), 0, scale);
  const bool* allowed = mask_rows ? mask_rows + i0 * s.tk : nullptr;
  T* rows = e.data_ptr<T>();
  for (int64_t i = 0; i < 2 * nb; ++i) {
    const int64_t row = i % nb, n = std::min(kend, reach(s, i0 + row));
    inv[i] = allowed ? exp_row<T, true>(rows + i * kend, n, kend, allowed + row * s.tk)
                     : exp_row<T, false>(rows + i * kend, n, kend, nullptr);
  }
}

// The (2, T, d) halves of a (B, N, 2, T, d) tensor at (b, n).
inline at::Tensor halves(const at::Tensor& x, int64_t b, int64_t n) { return x.select(0, b).select(0, n); }

inline const bool* mask_rows_of(const at::Tensor& mask, const Shapes& s, int64_t b) {
  return mask.defined() ? mask.data_ptr<bool>() + (mask.size(0) == 1 ? 0 : b) * s.tq * s.tk : nullptr;
}

int64_t keys_of_block(const Shapes& s, int64_t i0, int64_t nb) { return s.causal ? reach(s, i0 + nb - 1) : s.tk; }

// A task on one of OpenMP's worker threads does not inherit the caller's thread-local dispatch state: grad mode is on
// there even when the caller's was off, and ATen's out= products refuse inputs that require grad. Each task's body
// therefore dispatches below autograd (the kernel is the op's implementation; autograd is the caller's business).
//
// How many tasks each (batch, key/value group) is split into so that every thread has work: 1 when the groups
// alone keep the threads evenly busy (one thread, a multiple of the threads, or at least four groups per thread),
// else enough splits for about two tasks per thread, at most one per (head, query block) unit. Task c of a group
// takes the units u = r * blocks + block with u % splits == c: round robin, so that under causality every task gets
// early (short) and late (long) blocks alike.
int64_t splits_of(const Shapes& s, int64_t block) {
  const int64_t threads = at::get_num_threads(), groups = s.b * s.hkv;
  if (threads <= 1 || groups % threads == 0 || groups >= 4 * threads) return 1;
  const int64_t units = s.rep * ((s.tq + block - 1) / block);
  return std::max<int64_t>(1, std::min(units, (2 * threads + groups - 1) / groups));
}

template <typename T>
at::Tensor forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double lambda, double scale,
                        bool causal, const at::Tensor& mask, int64_t block) {
  const Shapes s = shapes_of(q, k, v, causal);
  at::Tensor out = at::empty({s.b, s.tq, s.h, s.dv}, q.options());  // A, token-major as out_proj reads it
  const T lam = static_cast<T>(lambda);
  const int64_t splits = splits_of(s, block), blocks = (s.tq + block - 1) / block;
  at::parallel_for(0, s.b * s.hkv * splits, 1, [&](int64_t begin, int64_t end) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;  // see splits_of
    at::Tensor maps = at::empty({2 * block * s.tk}, q.options());
    std::vector<T> inv(2 * block);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / splits, b = bg / s.hkv, g = bg % s.hkv;
      const at::Tensor vg = v.select(0, b).select(0, g), kg = halves(k, b, g);
      for (int64_t u = task % splits; u < s.rep * blocks; u += splits) {
        const int64_t h = g * s.rep + u / blocks, i0 = (u % blocks) * block;
        const int64_t nb = std::min(block, s.tq - i0), kend = keys_of_block(s, i0, nb);
        at::Tensor o = out.select(0, b).select(1, h).narrow(0, i0, nb);
        if (kend == 0) {
          o.zero_();
          continue;
        }
        at::Tensor e = maps.narrow(0, 0, 2 * nb * kend).view({2, nb, kend});
        block_exps<T>(s, halves(q, b, h), kg, mask_rows_of(mask, s, b), scale, i0, nb, kend, e, inv.data());
        T* e1 = e.data_ptr<T>();
        const T* e2 = e1 + nb * kend;
        for (int64_t i = 0; i < nb; ++i) {  // P1 - lambda P2, in place of e1
          const T w1 = inv[i], w2 = lam * inv[nb + i];
          for (int64_t j = i * kend; j < (i + 1) * kend; ++j) e1[j] = e1[j] * w1 - e2[j] * w2;
        }
        at::mm_out(o, e.select(0, 0), vg.narrow(0, 0, kend));
      }
    }
  });
  return out;
}

// The backward's tasks as the forward's (splits_of). dQ of a (head, query block) unit is written by its one task;
// dK and dV of a group sum over its units: with more than one split, task c > 0 of a group accumulates into its own
// zeroed partial (dk_part, dv_part), added to dK and dV in split order after the loop, and each task's share of
// the lambda gradient is kept apart and summed in task order, so that the result does not depend on which thread
// finished first.
template <typename T>
std::vector<at::Tensor> backward_impl(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, double lambda, double scale, bool causal,
                                      const at::Tensor& mask, int64_t block) {
  const Shapes s = shapes_of(q, k, v, causal);
  at::Tensor dq = at::zeros({s.b, s.h, 2, s.tq, s.d}, q.options());
  at::Tensor dk = at::zeros({s.b, s.hkv, 2, s.tk, s.d}, q.options());
  at::Tensor dv = at::zeros({s.b, s.hkv, s.tk, s.dv}, q.options());
  const at::Tensor dout = grad_out.contiguous();
  const T lam = static_cast<T>(lambda);
  const int64_t splits = splits_of(s, block), blocks = (s.tq + block - 1) / block, tasks = s.b * s.hkv * splits;
  at::Tensor dk_part, dv_part;
  if (splits > 1) {
    dk_part = at::zeros({splits - 1, s.b, s.hkv, 2, s.tk, s.d}, q.options());
    dv_part = at::zeros({splits - 1, s.b, s.hkv, s.tk, s.dv}, q.options());
  }
  std::vector<double> dlams(tasks, 0.0);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;  // see splits_of
    at::Tensor maps = at::empty({2 * block * s.tk}, q.options()), dp = at::empty({block * s.tk}, q.options());
    std::vector<T> inv(2 * block);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / splits, b = bg / s.hkv, g = bg % s.hkv, split = task % splits;
      const at::Tensor vg = v.select(0, b).select(0, g), kg = halves(k, b, g);
      at::Tensor dvg = (split == 0 ? dv : dv_part[split - 1]).select(0, b).select(0, g);
      at::Tensor dkg = halves(split == 0 ? dk : dk_part[split - 1], b, g);
      double dlam_local = 0;
      for (int64_t u = split; u < s.rep * blocks; u += splits) {
        const int64_t h = g * s.rep + u / blocks, i0 = (u % blocks) * block;
        const int64_t nb = std::min(block, s.tq - i0), kend = keys_of_block(s, i0, nb);
        if (kend == 0) continue;
        const at::Tensor qh = halves(q, b, h);
        at::Tensor e = maps.narrow(0, 0, 2 * nb * kend).view({2, nb, kend});
        at::Tensor g12 = dp.narrow(0, 0, nb * kend).view({nb, kend});
        block_exps<T>(s, qh, kg, mask_rows_of(mask, s, b), scale, i0, nb, kend, e, inv.data());
        const at::Tensor dob = dout.select(0, b).select(1, h).narrow(0, i0, nb);
        const at::Tensor vb = vg.narrow(0, 0, kend);
        // dV += (P1 - lambda P2)^T dO, the combined map built in the dP buffer before dP overwrites it.
        T* a = e.data_ptr<T>();
        T* c = a + nb * kend;
        T* gp = g12.data_ptr<T>();
        for (int64_t i = 0; i < nb; ++i) {  // normalise both maps in place
          const T w1 = inv[i], w2 = inv[nb + i];
          for (int64_t j = i * kend; j < (i + 1) * kend; ++j) {
            a[j] *= w1;
            c[j] *= w2;
            gp[j] = a[j] - lam * c[j];
          }
        }
        dvg.narrow(0, 0, kend).addmm_(g12.t(), dob);
        at::mm_out(g12, dob, vb.t());  // dP = dO V^T: map 1 receives dP, map 2 -lambda dP
        for (int64_t i = 0; i < nb; ++i) {
          T* a_i = a + i * kend;
          T* c_i = c + i * kend;
          const T* g_i = gp + i * kend;
          T dot1 = 0, dot2 = 0;
          for (int64_t j = 0; j < kend; ++j) {
            dot1 += a_i[j] * g_i[j];
            dot2 += c_i[j] * g_i[j];
          }
          dlam_local -= dot2;
          for (int64_t j = 0; j < kend; ++j) {
            a_i[j] = a_i[j] * (g_i[j] - dot1);
            c_i[j] = -lam * c_i[j] * (g_i[j] - dot2);
          }
        }
        // dS_c is now in e[c]: dQ = scale dS K and dK += scale dS^T Q, both maps in one batched product each
        at::Tensor dqb = halves(dq, b, h).narrow(1, i0, nb);
        at::baddbmm_out(dqb, dqb, e, kg.narrow(1, 0, kend), 0, scale);
        dkg.narrow(1, 0, kend).baddbmm_(e.transpose(1, 2), qh.narrow(1, i0, nb), 1, scale);
      }
      dlams[task] = dlam_local;
    }
  });
  for (int64_t c = 0; c + 1 < splits; ++c) {
    dk.add_(dk_part[c]);
    dv.add_(dv_part[c]);
  }
  double dlam = 0;
  for (const double x : dlams) dlam += x;
  return {dq, dk, dv, at::scalar_tensor(dlam, q.options())};
}

// out[j] = scale * (q . k_j) for the n keys k_j = k + j * ks: four keys at a time, so that each pass over q serves
// four dot products and the horizontal sums are amortised.
template <typename T>
void scores_of(const T* __restrict q, const T* __restrict k, int64_t ks, int64_t n, int64_t d, T scale,
               T* __restrict out) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const T* k0 = k + j * ks;
    const T* k1 = k0 + ks;
    const T* k2 = k1 + ks;
    const T* k3 = k2 + ks;
    T a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (int64_t x = 0; x < d; ++x) {
      const T qx = q[x];
      a0 += qx * k0[x];
      a1 += qx * k1[x];
      a2 += qx * k2[x];
      a3 += qx * k3[x];
    }
    out[j] = a0 * scale;
    out[j + 1] = a1 * scale;
    out[j + 2] = a2 * scale;
    out[j + 3] = a3 * scale;
  }
  for (; j < n; ++j) {
    const T* kj = k + j * ks;
    T a = 0;
    for (int64_t x = 0; x < d; ++x) a += q[x] * kj[x];
    out[j] = a * scale;
  }
}

// acc += sum_j p[j] v_j over the n values v_j = v + j * vs (width dv): four values per update of acc.
template <typename T>
void accumulate(const T* __restrict p, const T* __restrict v, int64_t vs, int64_t n, int64_t dv, T* __restrict acc) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const T* v0 = v + j * vs;
    const T* v1 = v0 + vs;
    const T* v2 = v1 + vs;
    const T* v3 = v2 + vs;
    const T p0 = p[j], p1 = p[j + 1], p2 = p[j + 2], p3 = p[j + 3];
    for (int64_t x = 0; x < dv; ++x) acc[x] += p0 * v0[x] + p1 * v1[x] + p2 * v2[x] + p3 * v3[x];
  }
  for (; j < n; ++j) {
    const T* vj = v + j * vs;
    const T pj = p[j];
    for (int64_t x = 0; x < dv; ++x) acc[x] += pj * vj[x];
  }
}

// Decoding: few query rows against a long cache, no gradient. Each query row (batch b, head g * rep + r, query i)
// is one task, handled alone: the scores of both maps, their softmax rows and (p1 - lambda p2) v in one pass over
// the cache by the kernel's own loops (no matrix-product calls, whose fixed cost dominates at one row), each cached
// value read once for both maps. With GQA the rep heads of a group each
// read the group's keys and values again. A row reads the keys up to its last visible one only: the slots a cache
// has not filled yet, masked, are skipped. q, k and v are read through their strides (a unit stride in the last
// dimension is required); the output is token-major (B, Tq, H, 2d).
// norm_weight: null for A itself; else each head's row becomes RMSNorm(A_h) * norm_weight * factor, the per-head
// norm of differential attention (factor 1 - lambda_init), computed as layers.py computes it. Without a weight, a
// factor other than 1 scales A (the ablation without the norm).
template <typename T>
at::Tensor decode_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double lambda, double scale,
                       bool causal, const at::Tensor& mask, const T* norm_weight = nullptr, double eps = 0,
                       double factor = 1) {
  const Shapes s = shapes_of(q, k, v, causal);
  at::Tensor out = at::empty({s.b, s.tq, s.h, s.dv}, q.options());
  const T lam = static_cast<T>(lambda), sc = static_cast<T>(scale);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2), qs3 = q.stride(3);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2), ks3 = k.stride(3);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t rows = s.rep * s.tq, d = s.d, dv = s.dv, tk = s.tk;
  // One task per query row; a thread takes at least ~64K multiply-adds' worth of rows (a short cache runs on one).
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, tk * (2 * d + dv)));
  at::parallel_for(0, s.b * s.hkv * rows, grain, [&](int64_t begin, int64_t end) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;  // see splits_of
    std::vector<T> e(2 * tk), acc(dv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / rows, row = task % rows, b = bg / s.hkv, g = bg % s.hkv;
      const int64_t r = row / s.tq, i = row % s.tq, h = g * s.rep + r;
      const bool* mrows = mask_rows_of(mask, s, b);
      const bool* allowed = mrows ? mrows + i * tk : nullptr;
      const T* vg = vp + b * vs0 + g * vs1;
      int64_t n = reach(s, i);
      if (allowed) {
        while (n > 0 && !allowed[n - 1]) --n;  // up to the last visible key
        // A cache's mask hides only the slots it has not filled (trimmed above) unless a batch is padded: a row
        // whose keys up to there are all visible takes the unmasked loops (one byte scan against 2d + 2d products)
        if (std::memchr(allowed, 0, static_cast<size_t>(n)) == nullptr) allowed = nullptr;
      }
      T w[2];
      for (int64_t c = 0; c < 2; ++c) {
        T* er = e.data() + c * tk;
        scores_of<T>(qp + b * qs0 + h * qs1 + c * qs2 + i * qs3, kp + b * ks0 + g * ks1 + c * ks2, ks3, n, d, sc,
                     er);
        w[c] = allowed ? exp_row<T, true>(er, n, n, allowed) : exp_row<T, false>(er, n, n, nullptr);
      }
      T* p = e.data();
      const T* p2 = e.data() + tk;
      const T w1 = w[0], w2 = lam * w[1];
      for (int64_t j = 0; j < n; ++j) p[j] = p[j] * w1 - p2[j] * w2;  // p1 - lambda p2
      std::fill(acc.begin(), acc.end(), T(0));
      accumulate<T>(p, vg, vs2, n, dv, acc.data());
      T* o = op + ((b * s.tq + i) * s.h + h) * dv;
      if (norm_weight != nullptr) {
        T ms = 0;
        for (int64_t x = 0; x < dv; ++x) ms += acc[x] * acc[x];
        const T rstd = T(1) / std::sqrt(ms / static_cast<T>(dv) + static_cast<T>(eps)), f = static_cast<T>(factor);
        for (int64_t x = 0; x < dv; ++x) o[x] = acc[x] * rstd * (norm_weight[x] * f);
      } else if (factor != 1) {
        const T f = static_cast<T>(factor);
        for (int64_t x = 0; x < dv; ++x) o[x] = acc[x] * f;
      } else {
        std::copy(acc.begin(), acc.end(), o);
      }
    }
  });
  return out;
}

// The mask as the loops read it: undefined, or boolean (B|1, Tq, Tk) contiguous on CPU (a broadcast query axis
// must be expanded by the caller; the rows are read by index).
at::Tensor checked_mask(const c10::optional<at::Tensor>& mask, const at::Tensor& q, const at::Tensor& k) {
  if (!mask.has_value() || !mask->defined()) return at::Tensor();
  const at::Tensor& m = *mask;
  TORCH_CHECK(m.device().is_cpu() && m.scalar_type() == at::kBool && m.dim() == 3 && m.is_contiguous() &&
                  (m.size(0) == 1 || m.size(0) == q.size(0)) && m.size(1) == q.size(3) && m.size(2) == k.size(3),
              "diff_block: mask must be a contiguous boolean CPU tensor (B|1, Tq, Tk) = (1 or ", q.size(0), ", ",
              q.size(3), ", ", k.size(3), "), got ", m.scalar_type(), " ", m.sizes(), " on ", m.device());
  return m;
}

at::Tensor diff_block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lam,
                              double scale, bool causal, const c10::optional<at::Tensor>& mask, int64_t block) {
  check_inputs(q, k, v, lam, block, nullptr);
  const at::Tensor m = checked_mask(mask, q, k);
  const double lambda = lam.item<double>();  // a CPU tensor: a read, not a device synchronisation
  if (q.scalar_type() == at::kDouble) return forward_impl<double>(q, k, v, lambda, scale, causal, m, block);
  return forward_impl<float>(q, k, v, lambda, scale, causal, m, block);
}

at::Tensor diff_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lam,
                       double scale, bool causal, const c10::optional<at::Tensor>& mask) {
  check_inputs(q, k, v, lam, 1, nullptr);
  const at::Tensor m = checked_mask(mask, q, k);
  const double lambda = lam.item<double>();
  if (q.scalar_type() == at::kDouble) return decode_impl<double>(q, k, v, lambda, scale, causal, m);
  return decode_impl<float>(q, k, v, lambda, scale, causal, m);
}

// A decode step of one differential attention layer's core after its projections: A from lambda (computed by the
// caller, MultiheadDiffAttn.lambda_full), then the per-head norm with weight norm_weight times factor (or, without
// the norm, the factor alone), token-major (B, Tq, H, 2d) as out_proj reads it.
at::Tensor diff_decode_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lam,
                             double scale, bool causal, const c10::optional<at::Tensor>& mask,
                             const c10::optional<at::Tensor>& norm_weight, double eps, double factor) {
  check_inputs(q, k, v, lam, 1, nullptr);
  const double lambda = lam.item<double>();
  const at::Tensor m = checked_mask(mask, q, k);
  at::Tensor w;
  if (norm_weight.has_value() && norm_weight->defined()) {
    w = *norm_weight;
    TORCH_CHECK(w.device().is_cpu() && w.dim() == 1 && w.is_contiguous() && w.numel() == v.size(3) &&
                    w.scalar_type() == q.scalar_type(),
                "diff_decode_heads: norm_weight must be a contiguous 1-D CPU tensor of ", v.size(3),
                " values in q's dtype ", q.scalar_type());
  }
  if (q.scalar_type() == at::kDouble)
    return decode_impl<double>(q, k, v, lambda, scale, causal, m, w.defined() ? w.data_ptr<double>() : nullptr, eps,
                               factor);
  return decode_impl<float>(q, k, v, lambda, scale, causal, m, w.defined() ? w.data_ptr<float>() : nullptr, eps,
                            factor);
}

std::vector<at::Tensor> diff_block_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, const at::Tensor& lam, double scale, bool causal,
                                            const c10::optional<at::Tensor>& mask, int64_t block) {
  check_inputs(q, k, v, lam, block, &grad_out);
  const at::Tensor m = checked_mask(mask, q, k);
  const double lambda = lam.item<double>();
  if (q.scalar_type() == at::kDouble)
    return backward_impl<double>(grad_out, q, k, v, lambda, scale, causal, m, block);
  return backward_impl<float>(grad_out, q, k, v, lambda, scale, causal, m, block);
}

// How many threads at::parallel_for runs this build's tasks on (the test that the kernel was built with OpenMP).
int64_t parallel_threads() {
  std::vector<char> seen(at::get_num_threads() + 1, 0);
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) { seen[at::get_thread_num()] = 1; });
  int64_t n = 0;
  for (const char x : seen) n += x;
  return n;
}

}  // namespace

// lambda is a one-element tensor (not a float) so that the caller never reads it on the host. The kernels are
// registered for the CPU dispatch key only: a CUDA or meta tensor gets the dispatcher's "could not run ... with
// arguments from the ... backend" instead of reaching the raw loops.
TORCH_LIBRARY(difftx, m) {
  m.def("diff_block_forward(Tensor q, Tensor k, Tensor v, Tensor lam, float scale, bool causal, Tensor? mask, "
        "int block) -> Tensor");
  m.def("diff_block_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor lam, float scale, bool causal, "
        "Tensor? mask, int block) -> Tensor[]");
  m.def("diff_decode(Tensor q, Tensor k, Tensor v, Tensor lam, float scale, bool causal, Tensor? mask) -> Tensor");
  m.def("diff_decode_heads(Tensor q, Tensor k, Tensor v, Tensor lam, float scale, bool causal, Tensor? mask, "
        "Tensor? norm_weight, float eps, float factor) -> Tensor");
  m.def("parallel_threads", &parallel_threads);  // no tensor arguments: one implementation for every backend
}

TORCH_LIBRARY_IMPL(difftx, CPU, m) {
  m.impl("diff_block_forward", &diff_block_forward);
  m.impl("diff_block_backward", &diff_block_backward);
  m.impl("diff_decode", &diff_decode);
  m.impl("diff_decode_heads", &diff_decode_heads);
}
