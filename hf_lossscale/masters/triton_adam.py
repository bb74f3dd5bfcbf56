"""The Triton source of the masters' one-pass Adam/AdamW step (`masters.kernel` prepares and launches it):
imported only where the kernel runs, so `import hf_lossscale` never imports Triton."""

import triton
import triton.language as tl

__all__ = ["master_adam"]


@triton.jit
def adam_block(
    offs, mask, other, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, weight_ptr, factor, scale,
    step_size, bc2_sqrt, lr, beta1, beta2, eps, wd,
    HAS_FACTOR: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_WD: tl.constexpr, DECOUPLED: tl.constexpr,
):  # fmt: skip
    # torch's fused CUDA Adam (`adam_math` in fused_adam_utils.cuh), in its order and precisions:
    # hyperparameters are doubles (here to 48 bits: two floats), the bias corrections and the values
    # FP32 ("opmath"), so each expression that mixes a hyperparameter in is computed in double and
    # rounded to FP32 where torch stores it. A full block comes with `mask` and `other` None: masked
    # loads do not vectorise, the tail's do not need to.
    grad = tl.load(grad_ptr + offs, mask=mask, other=other).to(tl.float32)
    param = tl.load(master_ptr + offs, mask=mask, other=other)
    exp_avg = tl.load(exp_avg_ptr + offs, mask=mask, other=other)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=other)
    if HAS_FACTOR:  # the unscale (and clip) factor, as the chunked path casts: FP32 (1: none)
        grad = grad * factor
    if HAS_SCALE:  # a fused optimizer's grad_scale: grad /= (double)*grad_scale
        grad = (grad.to(tl.float64) / scale).to(tl.float32)
    if HAS_WD:
        if DECOUPLED:
            param = (param.to(tl.float64) - lr * wd * param.to(tl.float64)).to(tl.float32)
        else:
            grad = (grad.to(tl.float64) + param.to(tl.float64) * wd).to(tl.float32)
    g64 = grad.to(tl.float64)
    exp_avg = (beta1 * exp_avg.to(tl.float64) + (1 - beta1) * g64).to(tl.float32)
    exp_avg_sq = (beta2 * exp_avg_sq.to(tl.float64) + (1 - beta2) * g64 * g64).to(tl.float32)
    # sqrt(v) / sqrt(bias correction 2) in FP32, then + eps in double
    denom = (tl.div_rn(tl.sqrt_rn(exp_avg_sq), bc2_sqrt).to(tl.float64) + eps).to(tl.float32)
    param = param - tl.div_rn(step_size * exp_avg, denom)  # IEEE division, as CUDA's `/`
    tl.store(master_ptr + offs, param, mask=mask)
    tl.store(exp_avg_ptr + offs, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, exp_avg_sq, mask=mask)
    tl.store(weight_ptr + offs, param.to(tl.float16), mask=mask)


@triton.jit
def master_adam(
    table_ptr, programs_ptr, scale_ptr, inf_ptr, corrections_ptr, first_program,
    lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo, eps_hi, eps_lo, wd_hi, wd_lo,
    HAS_FACTOR: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, HAS_WD: tl.constexpr,
    DECOUPLED: tl.constexpr, ALIGNED: tl.constexpr, COLUMNS: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    program = first_program + tl.program_id(0)  # (the aligned tensors' programs come first)
    t = tl.load(programs_ptr + 2 * program)
    first = tl.load(programs_ptr + 2 * program + 1)
    row = table_ptr + COLUMNS * t
    grad_ptr = tl.load(row).to(tl.pointer_type(tl.float16))
    factor_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    master_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    exp_avg_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    exp_avg_sq_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    weight_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float16))
    if ALIGNED:  # every block address of the launch 16-byte aligned (the host checks): vector accesses
        # (a compile-time branch: `multiple_of` marks the value itself, so a run-time one would mark
        # the unaligned tensors' accesses too)
        grad_ptr = tl.multiple_of(grad_ptr, 16)
        master_ptr = tl.multiple_of(master_ptr, 16)
        exp_avg_ptr = tl.multiple_of(exp_avg_ptr, 16)
        exp_avg_sq_ptr = tl.multiple_of(exp_avg_sq_ptr, 16)
        weight_ptr = tl.multiple_of(weight_ptr, 16)
    n = tl.load(row + 6)
    last = tl.minimum(first + CHUNK, n)
    full = first + (last - first) // BLOCK * BLOCK  # the end of the chunk's full blocks
    # doubles, each passed as two floats (kernel float arguments are FP32)
    lr = tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)
    wd = tl.cast(wd_hi, tl.float64) + tl.cast(wd_lo, tl.float64)
    beta1 = tl.cast(beta1_hi, tl.float64) + tl.cast(beta1_lo, tl.float64)
    beta2 = tl.cast(beta2_hi, tl.float64) + tl.cast(beta2_lo, tl.float64)
    eps = tl.cast(eps_hi, tl.float64) + tl.cast(eps_lo, tl.float64)
    # (lr / bias correction 1, sqrt(bias correction 2)), FP32, per tensor
    step_size = tl.load(corrections_ptr + 2 * t)
    bc2_sqrt = tl.load(corrections_ptr + 2 * t + 1)
    # the per-step scalars, read once (the compiler cannot keep them across the stores: they may alias)
    factor = 1.0
    if HAS_FACTOR:
        factor = tl.load(factor_ptr)
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr).to(tl.float64)
    flag = 0.0
    if HAS_INF:  # a skipped step writes nothing: one branch for the whole program
        flag = tl.load(inf_ptr)
    if flag == 0:
        for start in range(first, full, BLOCK):  # the whole blocks (`first` is a multiple of BLOCK)
            offs = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
            adam_block(
                offs, None, None, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, weight_ptr, factor, scale,
                step_size, bc2_sqrt, lr, beta1, beta2, eps, wd, HAS_FACTOR, HAS_SCALE, HAS_WD, DECOUPLED,
            )  # fmt: skip
        if full < last:  # the tail, masked
            offs = full + tl.arange(0, BLOCK)
            adam_block(
                offs, offs < last, 0.0, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, weight_ptr, factor,
                scale, step_size, bc2_sqrt, lr, beta1, beta2, eps, wd, HAS_FACTOR, HAS_SCALE, HAS_WD, DECOUPLED,
            )  # fmt: skip
