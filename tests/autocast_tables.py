"""torch's autocast op tables, transcribed: the oracle for `fp16_emulation(policy="cuda")`, which
cannot be checked against real CUDA autocast without a GPU.

Source: PyTorch documentation, "Automatic Mixed Precision package - torch.amp", sections
"CUDA Op-Specific Behavior" and "CPU Op-Specific Behavior" (`docs/source/amp.md` in
pytorch/pytorch, commit 4e0ff98084d470b85e94fccdca7213f6580b1d5b), for the pinned torch 2.13
(`hf_lossscale/_compat.py`). Transcribed 2026-12-03. The CPU lists are given for bfloat16;
"float16 shares the lists of bfloat16". Names are as the documentation spells them (aten names,
function names or module names).

The documentation is not complete: autocast's source (`aten/src/ATen/autocast_mode.h`) also
runs `scaled_dot_product_attention`, `linalg_vecdot`, `einsum`, `chain_matmul` and the RNN cells in
FP16 and `linalg_vector_norm`, `linalg_matrix_norm`, `logsumexp`, `frobenius_norm`,
`nuclear_norm`, `huber_loss`, `upsample_*`/`interpolate`, `multilabel_soft_margin_loss` (as its
parts) in FP32 on CUDA. `CUDA_FROM_SOURCE` lists the ones the policy uses.
"""

CUDA_FP16 = [
    "__matmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "multi_dot", "conv1d",
    "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "GRUCell",
    "linear", "LSTMCell", "matmul", "mm", "mv", "prelu", "RNNCell",
]  # fmt: skip

CUDA_FP32 = [
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin",
    "binary_cross_entropy_with_logits", "cosh", "cosine_embedding_loss", "cdist",
    "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv", "exp", "expm1",
    "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log", "log_softmax",
    "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss", "multilabel_margin_loss",
    "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist", "poisson_nll_loss", "pow",
    "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss", "soft_margin_loss", "softmax",
    "softmin", "softplus", "sum", "renorm", "tan", "triplet_margin_loss",
]  # fmt: skip

CUDA_PROMOTE = [
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sample", "index_put",
    "scatter_add", "tensordot",
]  # fmt: skip

# In autocast's source, not in the documentation's lists (see the module docstring).
CUDA_FROM_SOURCE = {
    "fp16": ["scaled_dot_product_attention", "linalg_vecdot", "einsum", "chain_matmul", "linalg_multi_dot"],
    "fp32": ["linalg_vector_norm", "linalg_matrix_norm", "logsumexp", "huber_loss", "interpolate"],
}

CPU_FP16 = [
    "conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm", "addbmm",
    "linear", "matmul", "_convolution", "conv_tbc", "mkldnn_rnn_layer", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "prelu", "scaled_dot_product_attention",
    "_native_multi_head_attention",
]  # fmt: skip

CPU_FP32 = [
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "grid_sampler_2d",
    "_grid_sampler_2d_cpu_fallback", "grid_sampler_3d", "polar", "prod", "quantile", "nanquantile",
    "stft", "cdist", "trace", "view_as_complex", "cholesky_inverse", "cholesky_solve", "inverse",
    "lu_solve", "orgqr", "ormqr", "pinverse", "max_pool3d", "max_unpool2d", "max_unpool3d",
    "adaptive_avg_pool3d", "reflection_pad1d", "reflection_pad2d", "replication_pad1d",
    "replication_pad2d", "replication_pad3d", "mse_loss", "cosine_embedding_loss", "nll_loss",
    "nll_loss2d", "hinge_embedding_loss", "poisson_nll_loss", "cross_entropy_loss", "l1_loss",
    "huber_loss", "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "ctc_loss", "kl_div", "multilabel_margin_loss",
    "binary_cross_entropy_with_logits", "fft_fft", "fft_ifft", "fft_fft2", "fft_ifft2", "fft_fftn",
    "fft_ifftn", "fft_rfft", "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn", "fft_irfftn",
    "fft_hfft", "fft_ihfft", "linalg_cond", "linalg_matrix_rank", "linalg_solve", "linalg_cholesky",
    "linalg_svdvals", "linalg_eigvals", "linalg_eigvalsh", "linalg_inv", "linalg_householder_product",
    "linalg_tensorinv", "linalg_tensorsolve", "fake_quantize_per_tensor_affine", "geqrf",
    "_lu_with_info", "qr", "svd", "triangular_solve", "fractional_max_pool2d",
    "fractional_max_pool3d", "adaptive_max_pool3d", "multilabel_margin_loss_forward", "linalg_qr",
    "linalg_cholesky_ex", "linalg_svd", "linalg_eig", "linalg_eigh", "linalg_lstsq", "linalg_inv_ex",
]  # fmt: skip

CPU_PROMOTE = ["cat", "stack", "index_copy"]
