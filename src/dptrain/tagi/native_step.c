/* One TAGI training step of a stack of LSTM, Linear and ReLU layers (and an EvenExp head), as
 * plain loops.
 *
 * The native form of dptrain.tagi's compiled step (docs/tagi.md, Compiled step) for the
 * networks of pytagi's examples at their small batches (its forecasting LSTMs, its MNIST
 * FNN), where per-operation overhead is most of the time torch spends on a step.
 * The math is the eager layers' (lstm.py, linear.py, activations.py's ReLU,
 * activations.py's EvenExp, output_updater.py's _innovations, update_using_indices and
 * _agvi_innovations, base.py's scale_deltas_ and capped_update_); sums run in another order than torch's, so the two agree to rounding (the
 * compiled step's tolerances: 1e-12 in float64, 1e-6 in float32).
 * It is compiled twice, REAL = float and REAL = double, into one library (native.py builds
 * and loads it); every buffer is allocated by the caller, so a step allocates nothing.
 *
 * Matrix products of a Linear layer large enough to pay for a call (BLAS_MACS) go to the
 * BLAS library torch itself links (its Fortran sgemm_/dgemm_, whose address native.py finds
 * and checks on a small product); smaller ones, and all of them where torch exports no BLAS,
 * are loops here. The step runs on one thread; where the library is MKL, a small step's
 * products too (native.ONE_THREAD_WORK): on two threads the products of pytagi's FNN at batch
 * 32 gained ~20 µs, and the capped step lost ~70 reading the half of the deltas the other
 * core had written.
 *
 * The LSTM is the non-carrying one: seq_len > 1 or batch > 1, so every previous hidden and
 * cell state is zero (native.py checks this before each step). With zero previous states the
 * forget gate reaches nothing: its pre-activation is not computed and its increments are
 * zero, as the eager coefficient a_f = J_f · c_prev = 0 makes them.
 *
 * A ReLU follows a Linear, and is followed by a Linear or ends the network; an EvenExp (the
 * heteroscedastic head) follows a Linear and ends it (native.py checks): an activation's J
 * multiplies the δ the next Linear passes down (or the output's innovations), as in eager,
 * where the backward skips activations.
 *
 * The plan (int64 words), per network: n_layers, batch, P, the addresses of `params`,
 * `deltas`, `work` and `grad`, the width of `grad`'s buffers, the BLAS product (0: none),
 * the fewest multiply-adds of a product that goes to it (native.BLAS_MACS),
 * MKL_Set_Num_Threads_Local (0: the products on the library's threads); then per layer
 *   kind (1 Linear, 2 LSTM, 3 ReLU, 4 EvenExp), I, O, T (1 but for an LSTM), has_bias, w (offset of
 *   the weights in a parameter row, or -1), b (offset of the biases, or -1), scratch (offset
 *   of the layer's buffers in `work`).
 * A layer's scratch: its output mean and variance (B x out width each); then for a Linear the
 * squares of its input (B x I), m_W² and m_W² + v_W (O x I each); for a ReLU or an EvenExp
 * its J (B x O);
 * for an LSTM the three gate coefficients a_i, a_c, a_o (B*T x 3 x O) of the backward pass,
 * the transposed weights (lstm_transposed_size), the backward's accumulators (2 x I x 3·O)
 * and 12·O values for one row.
 * `params`, `deltas`: (2, P) rows, means then variances. `grad`: two (B x widest) pairs of
 * buffers for the innovations passed down.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef REAL
#define REAL float
#endif
#ifndef SUFFIX
#define SUFFIX _f32
#endif
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define NAME(n) CAT(n, SUFFIX)

enum { LINEAR = 1, LSTM = 2, RELU = 3, EVENEXP = 4, WORDS = 8, HEAD = 11 };
enum { PLAIN = 0, INDICES = 1, HETEROS = 2 }; /* the output update */

/* MKL_Set_Num_Threads_Local: the BLAS library's threads for the calling thread */
typedef int (*threads_fn)(int);

/* Fortran BLAS ?gemm_ (column-major). Its integers are passed as pointers to int64 values:
 * on a little-endian machine a library with 32-bit integers (LP64) reads their low half, one
 * with 64-bit integers (ILP64) the whole, and both read the right value (native.py checks
 * the library it finds on a small product first). */
typedef void (*gemm_fn)(const char *, const char *, const int64_t *, const int64_t *,
                        const int64_t *, const REAL *, const REAL *, const int64_t *,
                        const REAL *, const int64_t *, const REAL *, REAL *, const int64_t *);

/* C (M x N) = op(A) op(B) + beta C, all row-major: the column-major call on the transposes */
static void gemm_rm(gemm_fn gemm, char ta, char tb, int64_t m, int64_t n, int64_t k,
                    const REAL *a, int64_t lda, const REAL *b, int64_t ldb, REAL beta, REAL *c,
                    int64_t ldc) {
    const REAL one = 1;
    gemm(&tb, &ta, &n, &m, &k, &one, b, &ldb, a, &lda, &beta, c, &ldc);
}

/* e^x and tanh for float as branch-free inline code the compiler vectorises (libm's are
 * calls, one value at a time: a third of the step's time). e^x = 2^n e^r with |r| ≤ ln 2 / 2
 * and e^r from Cephes' degree-6 polynomial; tanh from Cephes' odd polynomial below 0.625 (no
 * cancellation near 0), else 1 − 2/(e^{2|x|} + 1). Both within ~2 ulp; NaN stays NaN. The
 * double build calls libm. */
static inline float exp_f32(float x) {
    x = x > 88.3f ? 88.3f : (x < -87.3f ? -87.3f : x); /* 2^n stays a normal float */
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float tanh_f32(float x) {
    const float a = fabsf(x), z = x * x;
    float p = -5.70498872745e-3f * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const float small = p * z * x + x;
    const float big = copysignf(1.0f - 2.0f / (exp_f32(2.0f * a) + 1.0f), x);
    return a < 0.625f ? small : big;
}

#ifdef REAL_IS_DOUBLE
#define r_exp exp
#define r_tanh tanh
#define r_sqrt sqrt
#define libm_exp exp
#define libm_expm1 expm1
#else
#define r_exp exp_f32
#define r_tanh tanh_f32
#define r_sqrt sqrtf
#define libm_exp expf /* a few values a step (the EvenExp head): libm's, as torch's */
#define libm_expm1 expm1f
#endif
static inline REAL sigmoid(REAL x) { return (REAL)1 / ((REAL)1 + r_exp(-x)); }

/* m_Z = W m_A + b; v_Z = m_A² v_Wᵀ + v_B (+ v_A (m_W² + v_W)ᵀ when the input has a variance) */
static void linear_forward(const int64_t *l, const REAL *mw, const REAL *vw, const REAL *mb,
                           const REAL *vb, const REAL *a, const REAL *va, int64_t batch,
                           REAL *mz, REAL *vz) {
    const int64_t in = l[1], out = l[2];
    for (int64_t b = 0; b < batch; b++) {
        const REAL *ar = a + b * in, *var = va ? va + b * in : 0;
        for (int64_t o = 0; o < out; o++) {
            const REAL *wr = mw + o * in, *vr = vw + o * in;
            REAL m = 0, v = 0, t = 0;
#pragma omp simd reduction(+ : m, v)
            for (int64_t k = 0; k < in; k++) {
                m += wr[k] * ar[k];
                v += (ar[k] * ar[k]) * vr[k];
            }
            if (mb) {
                m += mb[o];
                v += vb[o];
            }
            if (var) {
#pragma omp simd reduction(+ : t)
                for (int64_t k = 0; k < in; k++) t += var[k] * (wr[k] * wr[k] + vr[k]);
                v += t;
            }
            mz[b * out + o] = m;
            vz[b * out + o] = v;
        }
    }
}

/* g_m = δmᵀ m_A, g_v = δvᵀ m_A² (+ the bias sums); the input's δ when asked for */
static void linear_backward(const int64_t *l, const REAL *mw, const REAL *a, int64_t batch,
                            const REAL *dm, const REAL *dv, REAL *gmw, REAL *gvw, REAL *gmb,
                            REAL *gvb, REAL *dm_in, REAL *dv_in) {
    const int64_t in = l[1], out = l[2];
    memset(gmw, 0, sizeof(REAL) * in * out);
    memset(gvw, 0, sizeof(REAL) * in * out);
    if (gmb) {
        memset(gmb, 0, sizeof(REAL) * out);
        memset(gvb, 0, sizeof(REAL) * out);
    }
    for (int64_t b = 0; b < batch; b++) {
        const REAL *ar = a + b * in;
        for (int64_t o = 0; o < out; o++) {
            const REAL m = dm[b * out + o], v = dv[b * out + o];
            REAL *gm = gmw + o * in, *gv = gvw + o * in;
            for (int64_t k = 0; k < in; k++) {
                gm[k] += m * ar[k];
                gv[k] += v * (ar[k] * ar[k]);
            }
            if (gmb) {
                gmb[o] += m;
                gvb[o] += v;
            }
        }
    }
    if (!dm_in) return;
    for (int64_t b = 0; b < batch; b++) {
        REAL *mi = dm_in + b * in, *vi = dv_in + b * in;
        memset(mi, 0, sizeof(REAL) * in);
        memset(vi, 0, sizeof(REAL) * in);
        for (int64_t o = 0; o < out; o++) {
            const REAL m = dm[b * out + o], v = dv[b * out + o];
            const REAL *wr = mw + o * in;
            for (int64_t k = 0; k < in; k++) {
                mi[k] += m * wr[k];
                vi[k] += v * (wr[k] * wr[k]);
            }
        }
    }
}

/* linear_forward through the BLAS library. `sq`: the layer's scratch after m_Z, v_Z (the
 * input's squares, then m_W² and m_W² + v_W, made when the input has a variance: a layer
 * past the first, which also passes δ down through m_W²). */
static void linear_forward_blas(gemm_fn gemm, const int64_t *l, const REAL *mw, const REAL *vw,
                                const REAL *mb, const REAL *vb, const REAL *a, const REAL *va,
                                int64_t batch, REAL *mz, REAL *vz, REAL *sq) {
    const int64_t in = l[1], out = l[2];
    REAL *restrict asq = sq, *restrict wsq = sq + batch * in, *restrict wt = wsq + in * out;
    for (int64_t k = 0; k < batch * in; k++) asq[k] = a[k] * a[k];
    REAL beta = 0;
    if (mb) {
        for (int64_t b = 0; b < batch; b++) {
            memcpy(mz + b * out, mb, sizeof(REAL) * out);
            memcpy(vz + b * out, vb, sizeof(REAL) * out);
        }
        beta = 1;
    }
    gemm_rm(gemm, 'N', 'T', batch, out, in, a, in, mw, in, beta, mz, out);
    gemm_rm(gemm, 'N', 'T', batch, out, in, asq, in, vw, in, beta, vz, out);
    if (!va) return;
    for (int64_t k = 0; k < in * out; k++) {
        wsq[k] = mw[k] * mw[k];
        wt[k] = wsq[k] + vw[k];
    }
    gemm_rm(gemm, 'N', 'T', batch, out, in, va, in, wt, in, 1, vz, out);
}

/* linear_backward through the BLAS library (`sq` as linear_forward_blas left it) */
static void linear_backward_blas(gemm_fn gemm, const int64_t *l, const REAL *mw, const REAL *a,
                                 const REAL *sq, int64_t batch, const REAL *dm, const REAL *dv,
                                 REAL *gmw, REAL *gvw, REAL *gmb, REAL *gvb, REAL *dm_in,
                                 REAL *dv_in) {
    const int64_t in = l[1], out = l[2];
    const REAL *asq = sq, *wsq = sq + batch * in;
    gemm_rm(gemm, 'T', 'N', out, in, batch, dm, out, a, in, 0, gmw, in);
    gemm_rm(gemm, 'T', 'N', out, in, batch, dv, out, asq, in, 0, gvw, in);
    if (gmb) {
        memset(gmb, 0, sizeof(REAL) * out);
        memset(gvb, 0, sizeof(REAL) * out);
        for (int64_t b = 0; b < batch; b++)
            for (int64_t o = 0; o < out; o++) {
                gmb[o] += dm[b * out + o];
                gvb[o] += dv[b * out + o];
            }
    }
    if (!dm_in) return;
    gemm_rm(gemm, 'N', 'N', batch, in, out, dm, out, mw, in, 0, dm_in, in);
    gemm_rm(gemm, 'N', 'N', batch, in, out, dv, out, wsq, in, 0, dv_in, in);
}

/* m_A = max(m_Z, 0), J = 1[m_Z > 0], v_A = J v_Z; NaN stays NaN in all three, as torch's
 * relu and sign keep it */
static void relu_forward(int64_t n, const REAL *restrict mz, const REAL *restrict vz,
                         REAL *restrict ma, REAL *restrict va, REAL *restrict jcb) {
    for (int64_t k = 0; k < n; k++) {
        const REAL m = mz[k];
        const REAL j = m > 0 ? (REAL)1 : (m == m ? (REAL)0 : m);
        ma[k] = m < 0 ? (REAL)0 : m;
        va[k] = vz[k] * j;
        jcb[k] = j;
    }
}

/* The LSTM's weights as (I x 4·O) column blocks, so that a row's gates are sums of vectors
 * over the units (loops the compiler vectorises): m_W, v_W, m_W² + v_W, and the products
 * w_i·w_c̃, w_i·w_o, w_c̃·w_o behind the covariances (I x 3·O). */
static void lstm_transpose(const int64_t *l, const REAL *mw, const REAL *vw, REAL *t) {
    const int64_t in = l[1], o = l[2], width = in + o, units = 4 * o;
    REAL *tm = t, *tv = tm + in * units, *tt = tv + in * units;
    REAL *cv = tt + in * units;
    for (int64_t u = 0; u < units; u++)
        for (int64_t k = 0; k < in; k++) {
            const REAL w = mw[u * width + k], v = vw[u * width + k];
            tm[k * units + u] = w;
            tv[k * units + u] = v;
            tt[k * units + u] = w * w + v;
        }
    for (int64_t j = 0; j < o; j++)
        for (int64_t k = 0; k < in; k++) {
            const REAL wi = mw[(o + j) * width + k], wc = mw[(2 * o + j) * width + k],
                       wo = mw[(3 * o + j) * width + k];
            cv[k * 3 * o + j] = wi * wc;
            cv[k * 3 * o + o + j] = wi * wo;
            cv[k * 3 * o + 2 * o + j] = wc * wo;
        }
}

static int64_t lstm_transposed_size(const int64_t *l) {
    return 3 * l[1] * 4 * l[2] + 3 * l[1] * l[2];
}

/* One row's gates (pre-activations zm, zv of i, c̃, o; covariance sums c0, c2, c3 when the
 * input has a variance), its cell and hidden states and its backward coefficients. */
static void lstm_row(int64_t o, int has_var, const REAL *restrict zm, const REAL *restrict zv,
                     const REAL *restrict c0, const REAL *restrict c2,
                     const REAL *restrict c3, REAL *restrict hm, REAL *restrict hv,
                     REAL *restrict cr) {
    for (int64_t j = 0; j < o; j++) {
        /* gates: sigmoid for i and o, tanh for c̃; J = (1 − m)(m + e) */
        const REAL mi = sigmoid(zm[j]), mc = r_tanh(zm[o + j]), mo = sigmoid(zm[2 * o + j]);
        const REAL ji = ((REAL)1 - mi) * mi, jc = ((REAL)1 - mc) * (mc + (REAL)1),
                   jo = ((REAL)1 - mo) * mo;
        const REAL vi = ji * ji * zv[j], vc = jc * jc * zv[o + j], vo = jo * jo * zv[2 * o + j];
        /* c = i·c̃ (+ Cov(i, c̃)) */
        const REAL prod_ic = mi * mc;
        REAL var_c = vc * (mi * mi + vi);
        var_c = var_c + vi * (mc * mc);
        REAL mu_c = prod_ic;
        if (has_var) {
            const REAL cov_ic = ji * jc * c0[j];
            mu_c = prod_ic + cov_ic;
            var_c = var_c + cov_ic * (mu_c + prod_ic);
        }
        const REAL mu_ca = r_tanh(mu_c), mu_ca_sq = mu_ca * mu_ca;
        const REAL jcb_ca = (REAL)1 - mu_ca_sq, var_ca = jcb_ca * jcb_ca * var_c;
        /* h = o·tanh(c) (+ Cov(o, tanh c)) */
        const REAL prod_h = mo * mu_ca;
        REAL var_h = var_ca * (mo * mo + vo);
        var_h = var_h + vo * mu_ca_sq;
        REAL mu_h = prod_h;
        if (has_var) {
            REAL paths = ji * mc * c2[j];
            paths = paths + (jc * mi) * c3[j];
            const REAL cov_oh = paths * jo * jcb_ca;
            mu_h = prod_h + cov_oh;
            var_h = var_h + cov_oh * (mu_h + prod_h);
        }
        hm[j] = mu_h;
        hv[j] = var_h;
        const REAL through_cell = jcb_ca * mo;
        cr[j] = ji * (through_cell * mc);
        cr[o + j] = jc * (through_cell * mi);
        cr[2 * o + j] = jo * mu_ca;
    }
}

/* The gates of all B*T rows (X = [x_t, 0]: only the I input columns count), the cell and
 * hidden states with Cov(i, c̃) and Cov(o, tanh c), and the backward coefficients a_i, a_c̃,
 * a_o. `t`: lstm_transpose's blocks; `row`: 7·O scratch values. */
static void lstm_forward(const int64_t *l, const REAL *mb, const REAL *vb, const REAL *t,
                         const REAL *x, const REAL *vx, int64_t batch, REAL *mh, REAL *vh,
                         REAL *coef, REAL *row) {
    const int64_t in = l[1], o = l[2], rows = batch * l[3], units = 4 * o, gates = 3 * o;
    const REAL *tm = t + o, *tv = t + in * units + o, *tt = t + 2 * in * units + o;
    const REAL *cv = t + 3 * in * units;
    REAL *zm = row, *zv = zm + gates, *c0 = zv + gates, *c2 = c0 + o, *c3 = c2 + o;
    for (int64_t r = 0; r < rows; r++) {
        const REAL *xr = x + r * in, *vxr = vx ? vx + r * in : 0;
        for (int64_t u = 0; u < gates; u++) { /* i, c̃, o; the forget gate reaches nothing */
            zm[u] = mb ? mb[o + u] : 0;
            zv[u] = vb ? vb[o + u] : 0;
        }
        for (int64_t k = 0; k < in; k++) {
            const REAL xk = xr[k], xk2 = xk * xk;
            const REAL *wm = tm + k * units, *wv = tv + k * units;
            for (int64_t u = 0; u < gates; u++) {
                zm[u] += xk * wm[u];
                zv[u] += xk2 * wv[u];
            }
        }
        if (vxr) {
            for (int64_t u = 0; u < gates; u++) c0[u] = 0; /* c0, c2, c3 */
            for (int64_t k = 0; k < in; k++) {
                const REAL vk = vxr[k], *wt = tt + k * units, *c = cv + k * gates;
                for (int64_t u = 0; u < gates; u++) zv[u] += vk * wt[u];
                for (int64_t u = 0; u < gates; u++) c0[u] += vk * c[u];
            }
        }
        if (vxr) /* two calls with a constant flag: each inlined copy is vectorised */
            lstm_row(o, 1, zm, zv, c0, c2, c3, mh + r * o, vh + r * o, coef + r * 3 * o);
        else
            lstm_row(o, 0, zm, zv, c0, c2, c3, mh + r * o, vh + r * o, coef + r * 3 * o);
    }
}

/* g_m, g_v of the gate weights (accumulated as (I x 3·O) blocks `acc`, then written in the
 * weights' layout, the forget gate's and the hidden columns' zero) and the input's δ. */
static void lstm_backward(const int64_t *l, const REAL *t, const REAL *x, int64_t batch,
                          const REAL *coef, const REAL *dm, const REAL *dv, REAL *gmw,
                          REAL *gvw, REAL *gmb, REAL *gvb, REAL *dm_in, REAL *dv_in,
                          REAL *acc, REAL *row) {
    const int64_t in = l[1], o = l[2], rows = batch * l[3], width = in + o, units = 4 * o,
                  gates = 3 * o;
    const REAL *tm = t + o;
    REAL *am = row, *av = am + gates, *bm = av + gates, *bv = bm + gates;
    REAL *accm = acc, *accv = acc + in * gates;
    for (int64_t u = 0; u < 2 * in * gates; u++) acc[u] = 0;
    for (int64_t u = 0; u < gates; u++) bm[u] = bv[u] = 0;
    for (int64_t r = 0; r < rows; r++) {
        const REAL *xr = x + r * in, *cr = coef + r * gates, *m = dm + r * o, *v = dv + r * o;
        for (int64_t g = 0; g < 3; g++)
            for (int64_t j = 0; j < o; j++) {
                const REAL a = cr[g * o + j];
                am[g * o + j] = a * m[j];
                av[g * o + j] = (a * a) * v[j];
            }
        for (int64_t u = 0; u < gates; u++) {
            bm[u] += am[u];
            bv[u] += av[u];
        }
        for (int64_t k = 0; k < in; k++) {
            const REAL xk = xr[k], xk2 = xk * xk;
            REAL *gm = accm + k * gates, *gv = accv + k * gates;
            for (int64_t u = 0; u < gates; u++) {
                gm[u] += am[u] * xk;
                gv[u] += av[u] * xk2;
            }
        }
        if (!dm_in) continue;
        /* δm_x = Σ_j δm_j s_j, δv_x = Σ_j δv_j s_j², s_j = Σ_g a_g,j w_g,j (the eager sum
         * over the 16 gate pairs, factored) */
        for (int64_t k = 0; k < in; k++) {
            const REAL *w = tm + k * units;
            REAL sm = 0, sv = 0;
#pragma omp simd reduction(+ : sm, sv)
            for (int64_t j = 0; j < o; j++) {
                const REAL s = cr[j] * w[j] + cr[o + j] * w[o + j] + cr[2 * o + j] * w[2 * o + j];
                sm += m[j] * s;
                sv += v[j] * (s * s);
            }
            dm_in[r * in + k] = sm;
            dv_in[r * in + k] = sv;
        }
    }
    memset(gmw, 0, sizeof(REAL) * units * width);
    memset(gvw, 0, sizeof(REAL) * units * width);
    for (int64_t u = 0; u < gates; u++)
        for (int64_t k = 0; k < in; k++) {
            gmw[(o + u) * width + k] = accm[k * gates + u];
            gvw[(o + u) * width + k] = accv[k * gates + u];
        }
    if (gmb) {
        for (int64_t j = 0; j < o; j++) gmb[j] = gvb[j] = 0;
        for (int64_t u = 0; u < gates; u++) {
            gmb[o + u] = bm[u];
            gvb[o + u] = bv[u];
        }
    }
}

/* EvenExp: (mean, log noise) pairs; the mean passes (J = 1), the noise becomes T = e^Z with
 * m_T = exp(m_Z + v_Z/2), v_T = m_T² expm1(v_Z), J = m_T. `pairs`: B x targets. */
static void evenexp_forward(int64_t pairs, const REAL *mz, const REAL *vz, REAL *ma, REAL *va,
                            REAL *jcb) {
    for (int64_t k = 0; k < 2 * pairs; k += 2) {
        const REAL mt = libm_exp(mz[k + 1] + (REAL)0.5 * vz[k + 1]);
        ma[k] = mz[k];
        va[k] = vz[k];
        jcb[k] = 1;
        ma[k + 1] = mt;
        va[k + 1] = mt * mt * libm_expm1(vz[k + 1]);
        jcb[k + 1] = mt;
    }
}

/* One observation's innovations (_innovations): δm = J (y − m)/(v + σ²), δv = −J²/(v + σ²),
 * both zero where δm is not finite (a NaN target). `jcb`: the output's J (a ReLU last), or 0. */
static inline void innovation(REAL mu, REAL var, REAL y, REAL noise, const REAL *jcb,
                              REAL *dm, REAL *dv) {
    const REAL inv_s = (REAL)1 / (var + noise);
    REAL m = (y - mu) * inv_s, v = -inv_s;
    if (jcb) {
        m = m * *jcb;
        v = (v * *jcb) * *jcb;
    }
    const int observed = isfinite(m);
    *dm = observed ? m : (REAL)0;
    *dv = observed ? v : (REAL)0;
}

/* The heteroscedastic (AGVI) update (_agvi_innovations) of (mean Y, noise T) output pairs,
 * one target each: the noise V ~ N(0, T) of y = Y + V, its posterior through V², and T's
 * through Cov(T, V²) = v_T; `jcb` the output's J (0: 1). All four δ of a pair are zero
 * where their sum is not finite (a NaN target). */
static void heteros_innovations(const REAL *mu, const REAL *var, const REAL *jcb,
                                const REAL *y, int64_t pairs, REAL *dm, REAL *dv) {
    for (int64_t k = 0; k < pairs; k++) {
        const int64_t e = 2 * k, o = e + 1;
        const REAL mu_y = mu[e], mu_t = mu[o], var_t = var[o];
        const REAL inv_s = (REAL)1 / (var[e] + mu_t);
        const REAL r = (y[k] - mu_y) * inv_s;
        const REAL mean_v = mu_t * r, var_v = mu_t * ((REAL)1 - mu_t * inv_s);
        const REAL mean_v_sq = mean_v * mean_v;
        const REAL prior = (REAL)3 * var_t + (REAL)2 * mu_t * mu_t;
        const REAL gain = var_t / prior;
        REAL jv = (jcb ? jcb[o] : (REAL)1) / var_t;
        jv = (isfinite(jv) ? jv : (REAL)0) * gain;
        const REAL jy = jcb ? jcb[e] : (REAL)1;
        const REAL d0 = jy * r, d1 = jv * (mean_v_sq + var_v - mu_t), d2 = -jy * jy * inv_s,
                   d3 = jv * jv * ((REAL)2 * var_v * (var_v + (REAL)2 * mean_v_sq) - prior);
        const int observed = isfinite(d0 + d1 + d2 + d3);
        dm[e] = observed ? d0 : (REAL)0;
        dm[o] = observed ? d1 : (REAL)0;
        dv[e] = observed ? d2 : (REAL)0;
        dv[o] = observed ? d3 : (REAL)0;
    }
}

/* The plain update: every output observed. `noise` is one value (noise_stride 0) or one
 * per output. */
static void innovations(const REAL *mu, const REAL *var, const REAL *jcb, const REAL *y,
                        const REAL *noise, int64_t noise_stride, int64_t n, REAL *dm,
                        REAL *dv) {
    for (int64_t k = 0; k < n; k++)
        innovation(mu[k], var[k], y[k], noise[k * noise_stride], jcb ? jcb + k : 0, dm + k,
                   dv + k);
}

/* update_using_indices: `obs` observations per sample at the 1-based outputs `idx` (B x obs),
 * targets `y` and noise as `idx`; other outputs get δ = 0, and an output selected twice
 * adds both innovations. */
static void indexed_innovations(const REAL *mu, const REAL *var, const REAL *jcb,
                                const REAL *y, const REAL *noise, int64_t noise_stride,
                                const int64_t *idx, int64_t batch, int64_t width, int64_t obs,
                                REAL *dm, REAL *dv) {
    memset(dm, 0, sizeof(REAL) * batch * width);
    memset(dv, 0, sizeof(REAL) * batch * width);
    for (int64_t b = 0; b < batch; b++)
        for (int64_t j = 0; j < obs; j++) {
            const int64_t r = b * obs + j, k = b * width + idx[r] - 1;
            REAL m, v;
            innovation(mu[k], var[k], y[r], noise[r * noise_stride], jcb ? jcb + k : 0, &m, &v);
            dm[k] += m;
            dv[k] += v;
        }
}

/* One parameter's capped step: m += clamp(Δm, ±bar), v += clamp(Δv, ±bar), bar = sqrt(v)/c,
 * and v ≤ 0 → var_floor (clamped as torch does: NaN stays NaN). lo, hi: −1/c and 1/c.
 * Data parallel, every rank does this to the same all-reduced deltas, each with its own build
 * (-march=native): keep it single IEEE operations, no libm call, no reduction, and no product
 * that feeds a sum (a multiply-add fused on one CPU and not on another rounds differently) —
 * the clamps stand between the products and the sums here. */
static inline void capped(REAL *restrict mu, REAL *restrict var, REAL dm, REAL dv, REAL lo,
                          REAL hi, REAL var_floor) {
    const REAL v = *var, root = r_sqrt(v), low = root * lo, high = root * hi;
    REAL cm = dm < low ? low : dm, cv = dv < low ? low : dv;
    cm = cm > high ? high : cm;
    cv = cv > high ? high : cv;
    *mu = *mu + cm;
    const REAL nv = v + cv;
    *var = nv > 0 ? nv : var_floor;
}

/* Δm = v g_m, Δv = v² g_v; then (do_step) the capped step, in the same pass over the
 * parameters. cap_lo, cap_hi: −1/c and 1/c as REAL. */
static void scaled_step(REAL *restrict params, REAL *restrict deltas, int64_t count,
                        int do_step, REAL cap_lo, REAL cap_hi, REAL var_floor) {
    REAL *restrict mu = params, *restrict var = params + count, *restrict dm = deltas,
                   *restrict dv = deltas + count;
    if (!do_step) {
        for (int64_t p = 0; p < count; p++) {
            const REAL v = var[p];
            dm[p] = dm[p] * v;
            dv[p] = (dv[p] * v) * v;
        }
        return;
    }
    for (int64_t p = 0; p < count; p++) {
        const REAL v = var[p], sm = dm[p] * v, sv = (dv[p] * v) * v;
        dm[p] = sm;
        dv[p] = sv;
        capped(mu + p, var + p, sm, sv, cap_lo, cap_hi, var_floor);
    }
}

/* The capped step alone, of deltas already scaled (data parallel: after their all-reduce). */
void NAME(capped_step)(const int64_t *plan, REAL cap_lo, REAL cap_hi, REAL var_floor) {
    const int64_t count = plan[2];
    REAL *restrict params = (REAL *)plan[3], *restrict deltas = (REAL *)plan[4];
    for (int64_t p = 0; p < count; p++)
        capped(params + p, params + count + p, deltas[p], deltas[count + p], cap_lo, cap_hi,
               var_floor);
}

/* The eager check of the input: its sum is finite (else the caller looks for the value). */
static int finite_input(const int64_t *plan, const REAL *x) {
    const int64_t *first = plan + HEAD;
    const int64_t values = plan[1] * first[1] * first[3];
    REAL sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < values; k++) sum += x[k];
    return isfinite(sum);
}

/* Whether a Linear layer's products go to the BLAS library */
static int blas_layer(const int64_t *plan, const int64_t *l) {
    return plan[8] && l[0] == LINEAR && plan[1] * l[1] * l[2] >= plan[9];
}

/* The forward moments of every layer into its scratch; the output's mean is returned and
 * its variance left in *va_out. */
static const REAL *forward(const int64_t *plan, const REAL *x, const REAL **va_out) {
    const int64_t layers = plan[0], batch = plan[1], count = plan[2];
    const REAL *params = (const REAL *)plan[3];
    REAL *work = (REAL *)plan[5];
    const gemm_fn gemm = (gemm_fn)plan[8];
    const REAL *a = x, *va = 0;
    for (int64_t n = 0; n < layers; n++) {
        const int64_t *l = plan + HEAD + n * WORDS;
        const REAL *mw = params + l[5], *vw = params + count + l[5];
        const REAL *mb = l[6] >= 0 ? params + l[6] : 0, *vb = l[6] >= 0 ? params + count + l[6] : 0;
        REAL *mz = work + l[7], *vz = mz + batch * l[2] * l[3];
        if (l[0] == RELU) {
            relu_forward(batch * l[2], a, va, mz, vz, vz + batch * l[2]);
        } else if (l[0] == EVENEXP) {
            evenexp_forward(batch * l[2] / 2, a, va, mz, vz, vz + batch * l[2]);
        } else if (blas_layer(plan, l)) {
            linear_forward_blas(gemm, l, mw, vw, mb, vb, a, va, batch, mz, vz,
                                vz + batch * l[2]);
        } else if (l[0] == LINEAR) {
            linear_forward(l, mw, vw, mb, vb, a, va, batch, mz, vz);
        } else {
            REAL *coef = vz + batch * l[2] * l[3], *t = coef + 3 * batch * l[2] * l[3];
            REAL *row = t + lstm_transposed_size(l) + 2 * l[1] * 3 * l[2];
            lstm_transpose(l, mw, vw, t);
            lstm_forward(l, mb, vb, t, a, va, batch, mz, vz, coef, row);
        }
        a = mz;
        va = vz;
    }
    *va_out = va;
    return a;
}

/* The whole step. x: (B, first layer's input width); `update` PLAIN (y: B x last width),
 * INDICES (y: B x obs, at `idx`, B x obs 1-based outputs, pytagi's: update_using_indices) or
 * HETEROS (y: B x half the last width; `noise` unused); out_mu, out_var: the network's output
 * before the update. Returns 0; or, writing nothing, 1 when `check_x` is set and the sum of x
 * is not finite, 2 when an index is out of range. */
int NAME(tagi_step)(const int64_t *plan, const REAL *x, int check_x, int update, const REAL *y,
                    const int64_t *idx, int64_t obs, const REAL *noise, int64_t noise_stride,
                    int do_step, REAL cap_lo, REAL cap_hi, REAL var_floor, REAL *out_mu,
                    REAL *out_var) {
    const int64_t layers = plan[0], batch = plan[1], count = plan[2], grad_width = plan[7];
    REAL *params = (REAL *)plan[3], *deltas = (REAL *)plan[4], *work = (REAL *)plan[5],
         *grad = (REAL *)plan[6];
    const gemm_fn gemm = (gemm_fn)plan[8];
    if (check_x && !finite_input(plan, x)) return 1;
    if (update == INDICES) {
        const int64_t *last = plan + HEAD + (layers - 1) * WORDS, width = last[2] * last[3];
        int64_t outside = 0;
        for (int64_t r = 0; r < batch * obs; r++) outside += idx[r] < 1 || idx[r] > width;
        if (outside) return 2;
    }
    const threads_fn local_threads = (threads_fn)plan[10];
    const int threads_before = local_threads ? local_threads(1) : 0;
    const REAL *va, *a = forward(plan, x, &va);
    const int64_t *last = plan + HEAD + (layers - 1) * WORDS;
    const int64_t width = last[2] * last[3], outputs = batch * width;
    const REAL *jcb = last[0] == RELU || last[0] == EVENEXP ? va + outputs : 0;
    memcpy(out_mu, a, sizeof(REAL) * outputs);
    memcpy(out_var, va, sizeof(REAL) * outputs);
    REAL *dm = grad, *dv = grad + batch * grad_width;
    REAL *dm_next = dv + batch * grad_width, *dv_next = dm_next + batch * grad_width;
    if (update == INDICES)
        indexed_innovations(a, va, jcb, y, noise, noise_stride, idx, batch, width, obs, dm, dv);
    else if (update == HETEROS)
        heteros_innovations(a, va, jcb, y, outputs / 2, dm, dv);
    else
        innovations(a, va, jcb, y, noise, noise_stride, outputs, dm, dv);
    for (int64_t n = layers - 1; n >= 0; n--) {
        const int64_t *l = plan + HEAD + n * WORDS;
        if (l[0] == RELU || l[0] == EVENEXP) continue; /* its J is applied already */
        const int64_t *below = n ? l - WORDS : 0;
        const REAL *in = n ? work + below[7] : x;
        const REAL *mw = params + l[5];
        REAL *gmb = l[6] >= 0 ? deltas + l[6] : 0, *gvb = l[6] >= 0 ? deltas + count + l[6] : 0;
        REAL *mi = n ? dm_next : 0, *vi = n ? dv_next : 0;
        const int64_t states = batch * l[2] * l[3];
        if (blas_layer(plan, l))
            linear_backward_blas(gemm, l, mw, in, work + l[7] + 2 * states, batch, dm, dv,
                                 deltas + l[5], deltas + count + l[5], gmb, gvb, mi, vi);
        else if (l[0] == LINEAR)
            linear_backward(l, mw, in, batch, dm, dv, deltas + l[5], deltas + count + l[5], gmb,
                            gvb, mi, vi);
        else {
            REAL *coef = work + l[7] + 2 * states, *t = coef + 3 * states;
            REAL *acc = t + lstm_transposed_size(l), *row = acc + 2 * l[1] * 3 * l[2];
            lstm_backward(l, t, in, batch, coef, dm, dv, deltas + l[5], deltas + count + l[5],
                          gmb, gvb, mi, vi, acc, row);
        }
        if (below && below[0] == RELU) { /* J ∈ {0, 1}: J² = J, as eager's one pass */
            const REAL *j = work + below[7] + 2 * batch * below[2];
            for (int64_t k = 0; k < batch * l[1]; k++) {
                mi[k] = mi[k] * j[k];
                vi[k] = vi[k] * j[k];
            }
        }
        REAL *t = dm; dm = dm_next; dm_next = t;
        t = dv; dv = dv_next; dv_next = t;
    }
    scaled_step(params, deltas, count, do_step, cap_lo, cap_hi, var_floor);
    if (local_threads) local_threads(threads_before);
    return 0;
}

/* The forward alone (an evaluation forward: the same moments, nothing stepped), its products
 * on the BLAS library's threads. Returns 0, or 1 (writing nothing) when `check_x` is set and
 * the sum of x is not finite. */
int NAME(tagi_forward)(const int64_t *plan, const REAL *x, int check_x, REAL *out_mu,
                       REAL *out_var) {
    if (check_x && !finite_input(plan, x)) return 1;
    const int64_t *last = plan + HEAD + (plan[0] - 1) * WORDS;
    const int64_t outputs = plan[1] * last[2] * last[3];
    const REAL *va, *a = forward(plan, x, &va);
    memcpy(out_mu, a, sizeof(REAL) * outputs);
    memcpy(out_var, va, sizeof(REAL) * outputs);
    return 0;
}

/* A product the caller checks `gemm` with (native.py): C (2 x 2) = A (2 x 3) Bᵀ (B: 2 x 3),
 * row-major, through gemm_rm as the step calls it. */
void NAME(gemm_probe)(int64_t gemm, const REAL *a, const REAL *b, REAL *c) {
    gemm_rm((gemm_fn)gemm, 'N', 'T', 2, 2, 3, a, 3, b, 3, 0, c, 2);
}
