"""torch's CUDA autocast op tables, transcribed: the oracle for `fp16_emulation(policy="cuda")`,
which cannot be checked against real CUDA autocast without a GPU.

Sources, for the pinned torch 2.13 (`hf_lossscale/integrations/compat.py`), transcribed 2026-12-03:

- `HEADER`: the op lists of `aten/src/ATen/autocast_mode.h` as shipped in the torch 2.13.0 wheel
  (`torch/include/ATen/autocast_mode.h`): `AT_FORALL_LOWER_PRECISION_FP` (FP16),
  `AT_FORALL_FP32` + `AT_FORALL_FP32_SET_OPT_DTYPE` + `norm` (FP32), `AT_FORALL_PROMOTE`.
  `tests/test_autocast_tables.py` re-reads the installed header and fails if it differs, so a
  torch upgrade cannot drift silently.
- `DOCS`: the documentation's lists, "CUDA Op-Specific Behavior" in "Automatic Mixed Precision
  package - torch.amp" (`docs/source/amp.md` in pytorch/pytorch, commit 4e0ff98084d4). They name
  Python-level functions and modules (`softmin`, `normalize`, `GRUCell`, `__rtruediv__`, ...) that
  reach the header's ops.

CPU autocast needs no table: its oracle is `torch.autocast("cpu", dtype=torch.float16)` itself.
"""

HEADER = {
    "fp16": [
        "_convolution", "_scaled_dot_product_flash_attention", "_thnn_fused_gru_cell",
        "_thnn_fused_lstm_cell", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm",
        "chain_matmul", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
        "conv_transpose2d", "conv_transpose3d", "convolution", "einsum", "gru_cell",
        "linalg_multi_dot", "linalg_vecdot", "linear", "lstm_cell", "matmul", "mm", "mv", "prelu",
        "rnn_relu_cell", "rnn_tanh_cell", "scaled_dot_product_attention",
    ],
    "fp32": [
        "_upsample_bicubic2d_aa", "_upsample_bilinear2d_aa", "_upsample_nearest_exact1d",
        "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "acos", "asin",
        "binary_cross_entropy_with_logits", "cdist", "cosh", "cosine_embedding_loss",
        "cosine_similarity", "dist", "erfinv", "exp", "expm1", "frobenius_norm", "group_norm",
        "hinge_embedding_loss", "huber_loss", "kl_div", "l1_loss", "layer_norm", "log", "log10",
        "log1p", "log2", "logsumexp", "margin_ranking_loss", "mse_loss", "multi_margin_loss",
        "multilabel_margin_loss", "native_layer_norm", "nll_loss", "nll_loss2d", "nuclear_norm",
        "pdist", "poisson_nll_loss", "pow", "reciprocal", "renorm", "rms_norm", "rsqrt", "sinh",
        "smooth_l1_loss", "soft_margin_loss", "softplus", "tan", "triplet_margin_loss",
        "upsample_bicubic2d", "upsample_bilinear2d", "upsample_linear1d", "upsample_nearest1d",
        "upsample_nearest2d", "upsample_nearest3d", "upsample_trilinear3d",
        # AT_FORALL_FP32_SET_OPT_DTYPE
        "cumprod", "cumsum", "linalg_matrix_norm", "linalg_vector_norm", "log_softmax", "prod",
        "softmax", "sum",
        # AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE
        "norm",
    ],
    "promote": [
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put",
        "scatter_add", "tensordot", "vdot",
    ],
}  # fmt: skip

DOCS = {
    "fp16": [
        "__matmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "multi_dot", "conv1d",
        "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "GRUCell",
        "linear", "LSTMCell", "matmul", "mm", "mv", "prelu", "RNNCell",
    ],
    "fp32": [
        "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin",
        "binary_cross_entropy_with_logits", "cosh", "cosine_embedding_loss", "cdist",
        "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv", "exp", "expm1",
        "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log",
        "log_softmax", "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss",
        "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist",
        "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss",
        "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan",
        "triplet_margin_loss",
    ],
    "promote": [
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sample", "index_put",
        "scatter_add", "tensordot",
    ],
}  # fmt: skip


def cuda_table() -> dict[str, set[str]]:
    """Both sources merged: op name -> "fp16" / "fp32" / "promote"."""
    out: dict[str, set[str]] = {}
    for source in (HEADER, DOCS):
        for kind, names in source.items():
            for name in names:
                out.setdefault(name, set()).add(kind)
    return out
