"""One sample call per autocast op name, for the table-driven emulation tests.

`SAMPLES[name](a, b)` calls the op the way user code reaches it (a function, a method, an operator
or a module), with `a` and `b` two (4, 8) floating tensors: `b` is a second operand where the op
takes one (ops of one input ignore it). `NOT_CALLED` names the table entries without a sample and
why (internal aten names reached only through a sampled public op).
"""

import torch
import torch.nn.functional as F

_g = torch.Generator().manual_seed(0)
IDX = torch.tensor([0, 2, 1, 3])
TARGET = torch.tensor([0, 1, 2, 3])
W88 = torch.randn(8, 8, generator=_g) * 0.3


def _cell(kind):
    def call(a, b):
        torch.manual_seed(0)
        cell = {"gru": torch.nn.GRUCell, "lstm": torch.nn.LSTMCell, "rnn": torch.nn.RNNCell}[kind](8, 8)
        out = cell(a, b) if kind != "lstm" else cell(a, (b, b))[0]
        return out

    return call


def _rnn_cell(fn, gates):
    def call(a, b):
        w_ih = torch.randn(gates * 8, 8, generator=torch.Generator().manual_seed(1)) * 0.3
        w_hh = torch.randn(gates * 8, 8, generator=torch.Generator().manual_seed(2)) * 0.3
        out = fn(a, (b, b) if fn is torch.lstm_cell else b, w_ih, w_hh)
        return out[0] if isinstance(out, tuple) else out

    return call


SAMPLES = {
    # ---- matrix products and convolutions (FP16 lists)
    "__matmul__": lambda a, b: a @ b.T,
    "__rmatmul__": lambda a, b: b.T.__rmatmul__(a),
    "matmul": lambda a, b: torch.matmul(a, b.T),
    "mm": lambda a, b: torch.mm(a, b.T),
    "mv": lambda a, b: torch.mv(a, b[0]),
    "bmm": lambda a, b: torch.bmm(a[None], b.T[None]),
    "baddbmm": lambda a, b: torch.baddbmm(a[None], a[None], b.T[None] @ torch.ones(4, 8)),
    "addmm": lambda a, b: torch.addmm(a, a, W88),
    "addmv": lambda a, b: torch.addmv(a[:, 0], a, b[0]),
    "addr": lambda a, b: torch.addr(a, a[:, 0], b[0]),
    "addbmm": lambda a, b: torch.addbmm(a, a[None], W88[None]),
    "einsum": lambda a, b: torch.einsum("ij,kj->ik", a, b),
    "chain_matmul": lambda a, b: torch.chain_matmul(a, b.T, a),
    "multi_dot": lambda a, b: torch.linalg.multi_dot([a, b.T, a]),
    "linalg_multi_dot": lambda a, b: torch.linalg.multi_dot([a, b.T, a]),
    "linalg_vecdot": lambda a, b: torch.linalg.vecdot(a, b),
    "linear": lambda a, b: F.linear(a, b),
    "conv1d": lambda a, b: F.conv1d(a[None], b.reshape(4, 4, 2)),
    "conv2d": lambda a, b: F.conv2d(a[None, None], b[None, None, :2, :2]),
    "conv3d": lambda a, b: F.conv3d(a[None, None, None], b[None, None, None, :2, :2]),
    "conv_transpose1d": lambda a, b: F.conv_transpose1d(a[None], b.reshape(4, 4, 2)),
    "conv_transpose2d": lambda a, b: F.conv_transpose2d(a[None, None], b[None, None, :2, :2]),
    "conv_transpose3d": lambda a, b: F.conv_transpose3d(a[None, None, None], b[None, None, None, :2, :2]),
    "conv_tbc": lambda a, b: torch.conv_tbc(
        a[:, None], b.reshape(1, 8, 4)[:, :, :4].repeat(1, 1, 2), torch.zeros(8)
    ),
    "convolution": lambda a, b: torch.convolution(
        a[None], b.reshape(4, 4, 2), None, [1], [0], [1], False, [0], 1
    ),
    "prelu": lambda a, b: F.prelu(a, torch.tensor([0.25])),
    "scaled_dot_product_attention": lambda a, b: F.scaled_dot_product_attention(a[None], b[None], b[None]),
    "lstm_cell": _rnn_cell(torch.lstm_cell, 4),
    "gru_cell": _rnn_cell(torch.gru_cell, 3),
    "rnn_tanh_cell": _rnn_cell(torch.rnn_tanh_cell, 1),
    "rnn_relu_cell": _rnn_cell(torch.rnn_relu_cell, 1),
    "GRUCell": _cell("gru"),
    "LSTMCell": _cell("lstm"),
    "RNNCell": _cell("rnn"),
    # ---- pointwise and reductions (FP32 on CUDA)
    "__pow__": lambda a, b: a**2,
    "__rpow__": lambda a, b: 2.0**a,
    "__rdiv__": lambda a, b: 2.0 / (a.abs() + 1),
    "__rtruediv__": lambda a, b: 2.0 / (a.abs() + 1),
    "pow": lambda a, b: torch.pow(a, 2),
    "acos": lambda a, b: torch.acos(a.tanh() * 0.9),
    "asin": lambda a, b: torch.asin(a.tanh() * 0.9),
    "cosh": lambda a, b: torch.cosh(a),
    "sinh": lambda a, b: torch.sinh(a),
    "tan": lambda a, b: torch.tan(a.tanh()),
    "erfinv": lambda a, b: torch.erfinv(a.tanh() * 0.9),
    "exp": lambda a, b: torch.exp(a),
    "expm1": lambda a, b: torch.expm1(a),
    "log": lambda a, b: torch.log(a.abs() + 1),
    "log10": lambda a, b: torch.log10(a.abs() + 1),
    "log1p": lambda a, b: torch.log1p(a.abs()),
    "log2": lambda a, b: torch.log2(a.abs() + 1),
    "reciprocal": lambda a, b: torch.reciprocal(a.abs() + 1),
    "rsqrt": lambda a, b: torch.rsqrt(a.abs() + 1),
    "softplus": lambda a, b: F.softplus(a),
    "softmax": lambda a, b: torch.softmax(a, -1),
    "log_softmax": lambda a, b: torch.log_softmax(a, -1),
    "softmin": lambda a, b: F.softmin(a, -1),
    "logsumexp": lambda a, b: torch.logsumexp(a, -1),
    "sum": lambda a, b: a.sum(-1),
    "prod": lambda a, b: a.prod(-1),
    "cumsum": lambda a, b: a.cumsum(-1),
    "cumprod": lambda a, b: a.cumprod(-1),
    "renorm": lambda a, b: torch.renorm(a, 2, 0, 1.0),
    "norm": lambda a, b: torch.norm(a, dim=-1),
    "normalize": lambda a, b: F.normalize(a, dim=-1),
    "vector_norm": lambda a, b: torch.linalg.vector_norm(a, dim=-1),
    "linalg_vector_norm": lambda a, b: torch.linalg.vector_norm(a, dim=-1),
    "matrix_norm": lambda a, b: torch.linalg.matrix_norm(a),
    "linalg_matrix_norm": lambda a, b: torch.linalg.matrix_norm(a),
    "linalg_norm": lambda a, b: torch.linalg.norm(a, dim=-1),
    "frobenius_norm": lambda a, b: torch.frobenius_norm(a, dim=[0, 1]),
    "nuclear_norm": lambda a, b: torch.nuclear_norm(a),
    "layer_norm": lambda a, b: F.layer_norm(a, (8,)),
    "group_norm": lambda a, b: F.group_norm(a, 2),
    "rms_norm": lambda a, b: F.rms_norm(a, (8,)),
    "interpolate": lambda a, b: F.interpolate(a[None], scale_factor=2, mode="linear"),
    "upsample": lambda a, b: F.interpolate(a[None], scale_factor=2, mode="nearest"),
    "cdist": lambda a, b: torch.cdist(a, b),
    "pdist": lambda a, b: F.pdist(a),
    "dist": lambda a, b: torch.dist(a, b),
    "cosine_similarity": lambda a, b: F.cosine_similarity(a, b),
    # ---- losses (FP32)
    "cross_entropy": lambda a, b: F.cross_entropy(a, TARGET),
    "nll_loss": lambda a, b: F.nll_loss(a.log_softmax(-1), TARGET),
    "nll_loss2d": lambda a, b: F.nll_loss(
        a.reshape(1, 8, 2, 2).log_softmax(1), torch.zeros(1, 2, 2, dtype=torch.long)
    ),
    "mse_loss": lambda a, b: F.mse_loss(a, b),
    "l1_loss": lambda a, b: F.l1_loss(a, b),
    "smooth_l1_loss": lambda a, b: F.smooth_l1_loss(a, b),
    "huber_loss": lambda a, b: F.huber_loss(a, b),
    "kl_div": lambda a, b: F.kl_div(a.log_softmax(-1), b.softmax(-1), reduction="batchmean"),
    "binary_cross_entropy_with_logits": lambda a, b: F.binary_cross_entropy_with_logits(a, b.sigmoid()),
    "poisson_nll_loss": lambda a, b: F.poisson_nll_loss(a, b.abs()),
    "cosine_embedding_loss": lambda a, b: F.cosine_embedding_loss(a, b, torch.ones(4)),
    "hinge_embedding_loss": lambda a, b: F.hinge_embedding_loss(a, torch.ones(4, 8)),
    "margin_ranking_loss": lambda a, b: F.margin_ranking_loss(a, b, torch.ones(4, 8)),
    "soft_margin_loss": lambda a, b: F.soft_margin_loss(a, torch.ones(4, 8)),
    "triplet_margin_loss": lambda a, b: F.triplet_margin_loss(a, b, b.flip(0)),
    "multi_margin_loss": lambda a, b: F.multi_margin_loss(a, TARGET),
    "multilabel_margin_loss": lambda a, b: F.multilabel_margin_loss(
        a, torch.full((4, 8), -1).index_fill(1, torch.tensor([0]), 1)
    ),
    "multilabel_soft_margin_loss": lambda a, b: F.multilabel_soft_margin_loss(a, (b > 0).float()),
    "ctc_loss": lambda a, b: F.ctc_loss(
        a.reshape(4, 1, 8).log_softmax(-1), torch.tensor([[1, 2]]), torch.tensor([4]), torch.tensor([2])
    ),
    # ---- ops that promote to the widest input (CUDA) / follow their inputs
    "addcdiv": lambda a, b: torch.addcdiv(a, a, b.abs() + 1),
    "addcmul": lambda a, b: torch.addcmul(a, a, b),
    "atan2": lambda a, b: torch.atan2(a, b),
    "bilinear": lambda a, b: F.bilinear(a, b, b[:2, :, None] * b[:2, None, :] * 0.1),
    "cross": lambda a, b: torch.cross(a[:, :3], b[:, :3], dim=1),
    "dot": lambda a, b: torch.dot(a[0], b[0]),
    "vdot": lambda a, b: torch.vdot(a[0], b[0]),
    "grid_sample": lambda a, b: F.grid_sample(
        a[None, None], b.reshape(1, 4, 4, 2).tanh(), align_corners=False
    ),
    "index_put": lambda a, b: a.index_put((IDX,), b),
    "scatter_add": lambda a, b: a.scatter_add(0, IDX[:, None].expand(4, 8), b),
    "tensordot": lambda a, b: torch.tensordot(a, b, dims=([1], [1])),
    "cat": lambda a, b: torch.cat([a, b]),
    "stack": lambda a, b: torch.stack([a, b]),
    "index_copy": lambda a, b: a.index_copy(0, IDX, b),
    # ---- CPU-only FP32 entries reachable from Python
    "avg_pool3d": lambda a, b: F.avg_pool3d(a[None, None, None], (1, 2, 2)),
    "max_pool3d": lambda a, b: F.max_pool3d(a[None, None, None], (1, 2, 2)),
    "adaptive_avg_pool3d": lambda a, b: F.adaptive_avg_pool3d(a[None, None, None], (1, 2, 2)),
    "adaptive_max_pool3d": lambda a, b: F.adaptive_max_pool3d(a[None, None, None], (1, 2, 2)),
    "reflection_pad1d": lambda a, b: F.pad(a[None], (1, 1), mode="reflect"),
    "reflection_pad2d": lambda a, b: F.pad(a[None, None], (1, 1, 1, 1), mode="reflect"),
    "replication_pad1d": lambda a, b: F.pad(a[None], (1, 1), mode="replicate"),
    "replication_pad2d": lambda a, b: F.pad(a[None, None], (1, 1, 1, 1), mode="replicate"),
    "replication_pad3d": lambda a, b: F.pad(a[None, None, None], (1, 1, 1, 1, 1, 1), mode="replicate"),
    "trace": lambda a, b: torch.trace(a),
    "quantile": lambda a, b: torch.quantile(a, 0.5, dim=-1),
    "nanquantile": lambda a, b: torch.nanquantile(a, 0.5, dim=-1),
    "fft_fft": lambda a, b: torch.fft.fft(a).real,
    "fft_rfft": lambda a, b: torch.fft.rfft(a).real,
    "fft_irfft": lambda a, b: torch.fft.irfft(a),
    "fft_hfft": lambda a, b: torch.fft.hfft(a),
    "fft_fft2": lambda a, b: torch.fft.fft2(a).real,
    "fft_rfft2": lambda a, b: torch.fft.rfft2(a).real,
    "fft_fftn": lambda a, b: torch.fft.fftn(a).real,
    "fft_rfftn": lambda a, b: torch.fft.rfftn(a).real,
    "fft_ihfft": lambda a, b: torch.fft.ihfft(a).real,
    "fft_ifft": lambda a, b: torch.fft.ifft(a).real,
    "fft_ifft2": lambda a, b: torch.fft.ifft2(a).real,
    "fft_ifftn": lambda a, b: torch.fft.ifftn(a).real,
    "fft_irfft2": lambda a, b: torch.fft.irfft2(a),
    "fft_irfftn": lambda a, b: torch.fft.irfftn(a),
    "pinverse": lambda a, b: torch.pinverse(a),
    "linalg_svdvals": lambda a, b: torch.linalg.svdvals(a),
    "linalg_matrix_rank": lambda a, b: torch.linalg.matrix_rank(a).float() + a.sum() * 0,
    "linalg_cond": lambda a, b: torch.linalg.cond(a[:, :4] + 4 * torch.eye(4)),
    "linalg_solve": lambda a, b: torch.linalg.solve(a[:, :4] + 4 * torch.eye(4), b[:, :1]),
    "linalg_inv": lambda a, b: torch.linalg.inv(a[:, :4] + 4 * torch.eye(4)),
    "inverse": lambda a, b: torch.inverse(a[:, :4] + 4 * torch.eye(4)),
    "linalg_cholesky": lambda a, b: torch.linalg.cholesky(a[:, :4] @ a[:, :4].T + 4 * torch.eye(4)),
    "linalg_eigvalsh": lambda a, b: torch.linalg.eigvalsh(a[:, :4] @ a[:, :4].T),
    "linalg_qr": lambda a, b: torch.linalg.qr(a)[1],
    "linalg_svd": lambda a, b: torch.linalg.svd(a, full_matrices=False)[1],
    "linalg_eigh": lambda a, b: torch.linalg.eigh(a[:, :4] @ a[:, :4].T)[0],
    "binary_cross_entropy": lambda a, b: F.binary_cross_entropy(a.sigmoid(), b.sigmoid()),
}

# Table entries without a sample: reached only through a sampled op, or not differentiable
# building blocks we never meet in training code.
NOT_CALLED = {
    "_convolution": "internal: conv*d go through it (sampled)",
    "_scaled_dot_product_flash_attention": "internal, CUDA kernels of scaled_dot_product_attention (sampled)",
    "_thnn_fused_lstm_cell": "internal CUDA fused kernel of lstm_cell (sampled)",
    "_thnn_fused_gru_cell": "internal CUDA fused kernel of gru_cell (sampled)",
    "native_layer_norm": "internal: layer_norm (sampled)",
    "upsample_nearest1d": "internal: interpolate (sampled, nearest)",
    "upsample_nearest2d": "internal: interpolate",
    "upsample_nearest3d": "internal: interpolate",
    "upsample_linear1d": "internal: interpolate (sampled, linear)",
    "upsample_bilinear2d": "internal: interpolate",
    "upsample_trilinear3d": "internal: interpolate",
    "upsample_bicubic2d": "internal: interpolate",
    "_upsample_bicubic2d_aa": "internal: interpolate(antialias=True)",
    "_upsample_bilinear2d_aa": "internal: interpolate(antialias=True)",
    "_upsample_nearest_exact1d": "internal: interpolate(mode='nearest-exact')",
    "_upsample_nearest_exact2d": "internal: interpolate(mode='nearest-exact')",
    "_upsample_nearest_exact3d": "internal: interpolate(mode='nearest-exact')",
    "grid_sampler": "internal: grid_sample (sampled)",
    "grid_sampler_2d": "internal: grid_sample (sampled)",
    "_grid_sampler_2d_cpu_fallback": "internal: grid_sample",
    "grid_sampler_3d": "internal: grid_sample on 5-d input",
    "cross_entropy_loss": "internal: cross_entropy (sampled)",
    "multilabel_margin_loss_forward": "internal: multilabel_margin_loss (sampled)",
    "mkldnn_rnn_layer": "internal CPU kernel of nn.LSTM/GRU with mkldnn",
    "_native_multi_head_attention": "internal: nn.MultiheadAttention fast path (inference only)",
    "_lu_with_info": "internal: torch.lu",
    "stft": "signal processing, complex output",
    "polar": "complex output",
    "view_as_complex": "complex output",
    "fake_quantize_per_tensor_affine": "quantization, not in FP16 training",
    "max_unpool2d": "needs pooling indices; not in transformer training",
    "max_unpool3d": "needs pooling indices; not in transformer training",
    "fractional_max_pool2d": "random samples per call: no deterministic comparison",
    "fractional_max_pool3d": "random samples per call: no deterministic comparison",
    "cholesky_inverse": "linear algebra on factors; not in transformer training",
    "cholesky_solve": "linear algebra on factors; not in transformer training",
    "lu_solve": "linear algebra on factors; not in transformer training",
    "orgqr": "linear algebra on factors; not in transformer training",
    "ormqr": "linear algebra on factors; not in transformer training",
    "geqrf": "linear algebra on factors; not in transformer training",
    "triangular_solve": "deprecated linear algebra",
    "qr": "deprecated alias of linalg_qr (sampled)",
    "svd": "deprecated alias of linalg_svd (sampled)",
    "linalg_householder_product": "linear algebra on factors; not in transformer training",
    "linalg_tensorinv": "composite of linalg_inv (sampled)",
    "linalg_tensorsolve": "composite of linalg_solve (sampled)",
    "linalg_eigvals": "complex output",
    "linalg_eig": "complex output",
    "linalg_lstsq": "no backward for all drivers",
    "linalg_cholesky_ex": "internal: linalg_cholesky (sampled)",
    "linalg_inv_ex": "internal: linalg_inv (sampled)",
}
