/* The FP32-master Adam/AdamW step for FP16 parameters on an x86-64 CPU, in one pass over memory
 * (issue 56): for each element it reads the FP16 gradient, the FP32 master and moments, runs torch's
 * fused CPU arithmetic (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, the float path: the same
 * operations in the same order, the same fused multiply-adds) and writes the master, the moments and
 * the FP16 weight (the master rounded to nearest). torch's own fused kernel takes one dtype, so on FP16
 * parameters it would need an FP32 copy of every gradient first and an FP16 write after: three passes.
 *
 * torch's kernel runs its vector loop over all but the last `numel % tail_width` elements of a tensor
 * and a scalar loop over those (tail_width: its vector's floats, 8 with AVX2, 16 with AVX-512); this
 * one does the same cut, so each element takes the same path (and rounding) as in torch's kernel.
 * Which fused multiply-adds the compiler of torch's build formed is not in its source:
 * `masters.cpu_kernel` checks this kernel against torch's on the machine before using it.
 *
 * Built by `masters.cpu_kernel` with the system's C compiler (-mavx2 -mfma -mf16c -ffp-contract=off).
 */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

typedef struct {
    const uint16_t *grad;     /* FP16 gradient */
    const float *factor;      /* its factor (the unscale and clip), NULL: none */
    float *master, *exp_avg, *exp_avg_sq;
    float *max_exp_avg_sq;    /* NULL without amsgrad */
    uint16_t *weight;         /* FP16 weight */
    const float *step;        /* the step counter, already moved */
    int64_t numel;
} hf_slot;

typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
    int64_t decoupled, amsgrad, maximize, tail_width;
    const float *grad_scale;  /* a fused optimizer's grad_scale (the gradient is divided by it), NULL: none */
    const float *found_inf;   /* NULL: none; 1.0: the step is skipped (nothing written) */
} hf_adam_args;

/* A tensor's constants, as torch's kernel computes them (in double, then FP32) */
typedef struct {
    float step_size_neg, bc2_sqrt, eps, beta2, c1, c2, decay, wd, factor, scale;
    int has_factor;
} consts;

static consts constants_of(const hf_slot *s, const hf_adam_args *a) {
    consts c;
    double step = (double)*s->step;
    double bc1 = 1 - pow(a->beta1, step), bc2 = 1 - pow(a->beta2, step);
    c.step_size_neg = (float)(-(a->lr / bc1));
    c.bc2_sqrt = (float)sqrt(bc2);
    c.eps = (float)a->eps;
    c.beta2 = (float)a->beta2;
    c.c1 = (float)(1 - a->beta1);
    c.c2 = (float)(1 - a->beta2);
    c.decay = (float)(1 - a->lr * a->weight_decay);
    c.wd = (float)a->weight_decay;
    c.has_factor = s->factor != 0;
    c.factor = s->factor ? *s->factor : 1.0f;
    c.scale = a->grad_scale ? *a->grad_scale : 1.0f;
    return c;
}

static void vector_part(const hf_slot *s, const hf_adam_args *a, const consts *c, int64_t begin, int64_t end) {
    const __m256 factor = _mm256_set1_ps(c->factor), scale = _mm256_set1_ps(c->scale);
    const __m256 minus_one = _mm256_set1_ps(-1.0f), wd = _mm256_set1_ps(c->wd), decay = _mm256_set1_ps(c->decay);
    const __m256 beta2 = _mm256_set1_ps(c->beta2), c2 = _mm256_set1_ps(c->c2);
    const __m256 bc2s = _mm256_set1_ps(c->bc2_sqrt), eps = _mm256_set1_ps(c->eps);
    const __m256 step_size = _mm256_set1_ps(c->step_size_neg);
    /* exp_avg.lerp_(grad, 1 - beta1), as torch's vector lerp: one weight for the whole call */
    const int small = fabsf(c->c1) < 0.5f;
    const __m256 coeff = _mm256_set1_ps(small ? c->c1 : c->c1 - 1.0f);
    for (int64_t d = begin; d < end; d += 8) {
        __m256 g = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s->grad + d)));
        if (c->has_factor) g = _mm256_mul_ps(g, factor);
        if (a->grad_scale) g = _mm256_div_ps(g, scale);
        if (a->maximize) g = _mm256_mul_ps(g, minus_one);
        __m256 p = _mm256_loadu_ps(s->master + d);
        if (c->wd != 0.0f) {
            if (a->decoupled) p = _mm256_mul_ps(p, decay);
            else g = _mm256_fmadd_ps(p, wd, g);
        }
        __m256 e = _mm256_loadu_ps(s->exp_avg + d);
        e = _mm256_fmadd_ps(coeff, _mm256_sub_ps(g, e), small ? e : g);
        __m256 v = _mm256_loadu_ps(s->exp_avg_sq + d);
        v = _mm256_fmadd_ps(_mm256_mul_ps(c2, g), g, _mm256_mul_ps(v, beta2));
        _mm256_storeu_ps(s->exp_avg + d, e);
        _mm256_storeu_ps(s->exp_avg_sq + d, v);
        if (a->amsgrad) {
            __m256 m = _mm256_max_ps(_mm256_loadu_ps(s->max_exp_avg_sq + d), v);
            _mm256_storeu_ps(s->max_exp_avg_sq + d, m);
            v = m;
        }
        __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2s), eps);
        p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(step_size, e), denom));
        _mm256_storeu_ps(s->master + d, p);
        _mm_storeu_si128((__m128i *)(s->weight + d), _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT));
    }
}

static void scalar_part(const hf_slot *s, const hf_adam_args *a, const consts *c, int64_t begin, int64_t end) {
    const int small = fabsf(c->c1) < 0.5f;
    for (int64_t d = begin; d < end; d++) {
        float g = _cvtsh_ss(s->grad[d]);
        if (c->has_factor) g = g * c->factor;
        if (a->grad_scale) g = g / c->scale;
        if (a->maximize) g = -g;
        float p = s->master[d];
        if (c->wd != 0.0f) {
            if (a->decoupled) p = p * c->decay;
            else g = fmaf(p, c->wd, g);
        }
        float e = s->exp_avg[d];
        e = small ? fmaf(c->c1, g - e, e) : fmaf(-(g - e), 1.0f - c->c1, g);
        float v = fmaf(s->exp_avg_sq[d], c->beta2, c->c2 * g * g);
        s->exp_avg[d] = e;
        s->exp_avg_sq[d] = v;
        if (a->amsgrad) {
            float m = fmaxf(s->max_exp_avg_sq[d], v);
            s->max_exp_avg_sq[d] = m;
            v = m;
        }
        float denom = sqrtf(v) / c->bc2_sqrt + c->eps;
        p = p - (-c->step_size_neg) * e / denom;
        s->master[d] = p;
        s->weight[d] = _cvtss_sh(p, _MM_FROUND_TO_NEAREST_INT);
    }
}

/* ------------------------------------------------------------------ the work, shared by threads
 * Work is cut into items of ITEM elements (a multiple of every tail width) taken by the threads in
 * turn; an item that reaches a tensor's end runs its scalar tail. */
#define ITEM ((int64_t)1 << 16)

typedef struct hf_work hf_work;
typedef void (*part_fn)(const hf_work *w, const hf_slot *s, int64_t begin, int64_t end, int64_t body);

struct hf_work {
    const hf_slot *slots;
    int64_t count;
    const void *args;
    part_fn run;              /* one item: the vector part below `body`, the scalar tail above */
    const int64_t *first;     /* each tensor's first item */
    int64_t items, tail_width;
    atomic_llong next;
};

static void run_item(hf_work *w, int64_t item) {
    int64_t lo = 0, hi = w->count; /* the tensor holding the item: first[t] <= item < first[t+1] */
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (w->first[mid] <= item) lo = mid; else hi = mid;
    }
    const hf_slot *s = &w->slots[lo];
    int64_t begin = (item - w->first[lo]) * ITEM;
    int64_t end = begin + ITEM < s->numel ? begin + ITEM : s->numel;
    w->run(w, s, begin, end, s->numel - s->numel % w->tail_width);
}

static void *worker(void *arg) {
    hf_work *w = (hf_work *)arg;
    for (;;) {
        int64_t item = atomic_fetch_add(&w->next, 1);
        if (item >= w->items) return 0;
        run_item(w, item);
    }
}

static int run_all(const hf_slot *slots, int64_t count, const void *args, part_fn run, int64_t tail_width,
                   int64_t threads, int64_t *first) {
    if (tail_width <= 0 || tail_width % 8 || ITEM % tail_width) return 1;
    int64_t items = 0;
    for (int64_t t = 0; t < count; t++) {
        first[t] = items;
        items += (slots[t].numel + ITEM - 1) / ITEM;
    }
    first[count] = items;
    hf_work w = {slots, count, args, run, first, items, tail_width, 0};
    if (threads > 64) threads = 64;
    if (threads > items) threads = items;
    pthread_t ids[64];
    int64_t started = 0;
    for (; started + 1 < threads; started++)
        if (pthread_create(&ids[started], 0, worker, &w)) break;
    worker(&w);
    for (int64_t i = 0; i < started; i++) pthread_join(ids[i], 0);
    return 0;
}

static void adam_part(const hf_work *w, const hf_slot *s, int64_t begin, int64_t end, int64_t body) {
    const hf_adam_args *a = (const hf_adam_args *)w->args;
    consts c = constants_of(s, a);
    int64_t vend = end < body ? end : body;
    if (vend > begin) vector_part(s, a, &c, begin, vend);
    if (end > body) scalar_part(s, a, &c, begin > body ? begin : body, end);
}

/* The Adam/AdamW step of `count` tensors with `threads` threads (the caller's among them). 0 on success. */
int hf_adam_fp16(const hf_slot *slots, int64_t count, const hf_adam_args *args, int64_t threads,
                 int64_t *first /* count + 1 entries, scratch */) {
    if (args->found_inf && *args->found_inf == 1.0f) return 0; /* as torch's fused kernel: a skip */
    return run_all(slots, count, args, adam_part, args->tail_width, threads, first);
}

/* ---------------------------------------------------------------- SGD, torch's for-loop / foreach
 * arithmetic (torch/optim/sgd.py): each of its tensor ops rounds once, the adds with an `alpha` as
 * fused multiply-adds (ATen's add kernel: `vec::fmadd(other, alpha, self)`). Every buffer exists (a
 * first step, which makes them, runs the chunked update). slot.exp_avg is the momentum buffer. */
typedef struct {
    double lr, momentum, dampening, weight_decay;
    int64_t nesterov, maximize, tail_width;
} hf_sgd_args;

static void sgd_part(const hf_work *w, const hf_slot *s, int64_t begin, int64_t end, int64_t body) {
    const hf_sgd_args *a = (const hf_sgd_args *)w->args;
    const float lr = (float)(-a->lr), mom = (float)a->momentum, keep = (float)(1 - a->dampening);
    const float wd = (float)a->weight_decay, factor = s->factor ? *s->factor : 1.0f;
    const int has_momentum = a->momentum != 0, has_factor = s->factor != 0;
    int64_t d = begin, vend = end < body ? end : body;
    const __m256 vlr = _mm256_set1_ps(lr), vmom = _mm256_set1_ps(mom), vkeep = _mm256_set1_ps(keep);
    const __m256 vwd = _mm256_set1_ps(wd), vfactor = _mm256_set1_ps(factor), sign = _mm256_set1_ps(-0.0f);
    for (; d + 8 <= vend; d += 8) {
        __m256 g = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s->grad + d)));
        if (has_factor) g = _mm256_mul_ps(g, vfactor);
        if (a->maximize) g = _mm256_xor_ps(g, sign); /* -grad: a zero becomes -0, as torch negates */
        __m256 p = _mm256_loadu_ps(s->master + d);
        if (a->weight_decay != 0) g = _mm256_fmadd_ps(p, vwd, g);
        if (has_momentum) {
            __m256 b = _mm256_fmadd_ps(g, vkeep, _mm256_mul_ps(_mm256_loadu_ps(s->exp_avg + d), vmom));
            _mm256_storeu_ps(s->exp_avg + d, b);
            g = a->nesterov ? _mm256_fmadd_ps(b, vmom, g) : b;
        }
        p = _mm256_fmadd_ps(g, vlr, p);
        _mm256_storeu_ps(s->master + d, p);
        _mm_storeu_si128((__m128i *)(s->weight + d), _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT));
    }
    for (; d < end; d++) {
        float g = _cvtsh_ss(s->grad[d]);
        if (has_factor) g = g * factor;
        if (a->maximize) g = -g;
        float p = s->master[d];
        if (a->weight_decay != 0) g = fmaf(p, wd, g);
        if (has_momentum) {
            float b = fmaf(g, keep, s->exp_avg[d] * mom);
            s->exp_avg[d] = b;
            g = a->nesterov ? fmaf(b, mom, g) : b;
        }
        p = fmaf(g, lr, p);
        s->master[d] = p;
        s->weight[d] = _cvtss_sh(p, _MM_FROUND_TO_NEAREST_INT);
    }
}

int hf_sgd_fp16(const hf_slot *slots, int64_t count, const hf_sgd_args *args, int64_t threads, int64_t *first) {
    return run_all(slots, count, args, sgd_part, args->tail_width, threads, first);
}
