"""Tolerances for float comparisons, derived from forward error bounds for the sizes compared, not from what one
machine's rounding happened to give. Import as `from tolerance import ...` (tests/ is on sys.path: tests/conftest.py).

Unit roundoff u: float64 2^-53, float32 2^-24, float16 2^-11, bfloat16 2^-8.

One operation. A dot product of length n, summed in any order (blocked, pairwise, SIMD lanes, fused multiply-adds),
satisfies |fl(x.y) - x.y| <= gamma_n sum |x_i y_i|, gamma_n = n u / (1 - n u) (Higham, Accuracy and Stability of
Numerical Algorithms, 2nd ed., 2002, eq. 3.5); elementwise for C = A B: |fl(C) - C| <= gamma_n |A| |B|
(`matmul_error_bound`, `linear_error_bound`). A log-softmax adds the relative error of its sum of exponentials
(`log_softmax_error`). Two float computations of the same value, each within its bound of it, differ by at most the
sum of the two bounds: `sides=2`; against a float64 reference only the float32 side counts (`sides=1`: the
float64 side's bound is 2^29 times smaller). These hold for every summation order, hence on every CPU.

A whole network (`network_tolerance`). Its output is a chain of N roundings from the input, N the sum of the inner
lengths of the sums on the longest path (`chain_length`: ~1,000-20,000 for the tiny test models, ~140,000 for
SmolLM2's 30 layers). The worst case gamma_N grows as N u: ~1e-2 for SmolLM2, a tolerance of several logit units,
above a transposed matrix's effect. So networks take the smaller of gamma_N and Higham and Mary's probabilistic
bound (A new approach to probabilistic rounding error analysis, SIAM J. Sci. Comput. 41(5), 2019, Thm. 2.4/3.1):
when the roundings are independent and of mean zero (the model for nearest rounding of varied data), the relative
error of N chained roundings is at most

    gamma~_N(lam) = exp(lam sqrt(N) u + N u^2 / (1 - u)) - 1  ~  lam sqrt(N) u

except with probability at most 2 N exp(-lam^2 (1 - u)^2 / 2) per output element: LAMBDA = 10 makes that < 1e-15
for N <= 10^6, < 1e-8 for a suite's ~10^7 compared elements together.

Relative to what: the network ends in RMSNorm and the LM head, z_j = sum_i W_ji g_i h_i / rms(h), and ||h/rms(h)||_2
= sqrt(d), so by Cauchy-Schwarz every logit and every partial sum of |W_ji g_i h_i / rms(h)| is at most
S = sqrt(d) max_j ||W_j * g||_2 (`logit_scale`, from the weights alone); an error of relative size e in the
normalized last hidden state moves a logit by at most e S. A hidden state's scale is its rows' largest 2-norm
(`row_scale`): every element of an error vector is at most the vector's 2-norm.

Amplification. The first-order error of the output is the sum over the chain's roundings of each one's effect.
Matmuls carry a componentwise relative error with factor 1 (|W| |dx| <= e |W| |x|), residual adds with factor 1;
every block reads the stream through an RMSNorm, which can double a relative error (||a/||a|| - b/||b||||_2 <=
2 ||a - b||_2 / ||a||_2); the other nonlinearities of these blocks act on normalized inputs with Lipschitz constants
at most 1 in the units they are rounded in (SiLU's derivative <= 1.1, sigmoid gates 1/4, softmax's log-derivative
<= 2 in score units of order 1, exp decays of arguments <= 0). AMPLIFICATION = 2 is the norm's factor; the rest is
assumed, not proved: a network whose blocks amplify errors (huge scores, unnormalized streams) needs more. Measured
against float64 runs of the suite's models, float32 errors stay below 1/10 of one side's bound (every4 Qwen3.5
with its chunked delta rule: 1.4e-4 of a 1.4e-3 side bound; SmolLM2: 8e-5 of 0.16).

Sensitivity: the network tolerances stay 1.5-3 orders of magnitude below what a real bug does to the logits
(tiny Qwen3.5: tolerance 2.8e-3; one flipped weight 0.34, a transposed o_proj 1.4; SmolLM2: tolerance 0.31,
a transposed o_proj in one layer 20, a missing norm 54).

Low precision. The same bound with bf16's u = 2^-8, or int8 activation codes (a step of 1/127 of a block's largest
value), is 25-100 % of the output's scale after the ~30-60 such roundings of a whole network: no check worth the
name. Such paths are bounded per operation instead (`q8_block_matmul_error_bound`, a bf16 matmul's float32 sums plus
its output rounding), or over one block, normwise per row.
"""

from __future__ import annotations

import math

import torch

UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
LAMBDA = 10.0
AMPLIFICATION = 2.0


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    return UNIT_ROUNDOFF[dtype]


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's gamma_n = n u / (1 - n u): the worst-case relative error of n chained roundings."""
    nu = n * unit_roundoff(dtype)
    assert nu < 1, f"gamma_{n} is not defined in {dtype} (n u >= 1)"
    return nu / (1 - nu)


def gamma_probabilistic(n: int, dtype: torch.dtype = torch.float32, lam: float = LAMBDA) -> float:
    """Higham and Mary's gamma~_n(lam): the relative error of n chained independent roundings, except with
    probability at most 2 n exp(-lam^2 (1 - u)^2 / 2)."""
    u = unit_roundoff(dtype)
    return math.expm1(lam * math.sqrt(n) * u + n * u * u / (1 - u))


def chain_gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """The smaller of the worst-case and the probabilistic bound (both hold; the first is smaller for n < lam^2)."""
    worst = gamma(n, dtype) if n * unit_roundoff(dtype) < 1 else math.inf
    return min(worst, gamma_probabilistic(n, dtype))


def matmul_error_bound(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """gamma_n |A| |B| elementwise, in float64: how far a @ b computed in `dtype` (any order) can be from the exact
    product of its inputs."""
    return gamma(a.shape[-1], dtype) * (a.double().abs() @ b.double().abs())


def linear_error_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The bound of F.linear(x, weight, bias): gamma_{n+1} (|x| |W|^T + |b|) (the bias add is one more rounding)."""
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    return gamma(x.shape[-1] + 1, dtype) * magnitude


def q8_block_matmul_error_bound(x: torch.Tensor, weight: torch.Tensor, group: int = 32) -> torch.Tensor:
    """How far llama.cpp's Q8_0 arithmetic (runtime/kernels/gguf_matmul.cpp with Q8_0 weights) can be from the float
    product x @ weight.T, elementwise. Per block of `group`: the weights' scale d = fp16(max|w| / 127) and codes
    round(w / d) put each weight within (1/2 + 127 u16 + 254 u) d of w (d rounded, then the code of w / d computed
    in float32); the activations' scale max|x| / 127 (float32) and codes within (1/2 + 254 u) of theirs; the block
    dots are exact integers, summed over the blocks in float32 after two scalings (gamma_{blocks + 2})."""
    u, u16 = unit_roundoff(), unit_roundoff(torch.float16)
    e_w = (0.5 + 127 * u16 + 254 * u) * (1 + u16) * (1 + u) / 127
    e_x = (0.5 + 254 * u) * (1 + u) / 127

    def block_max(t: torch.Tensor) -> torch.Tensor:
        blocks = t.double().abs().unflatten(-1, (-1, group))
        return blocks.amax(-1, keepdim=True).expand(blocks.shape).flatten(-2)

    x_abs, w_abs, x_max, w_max = x.double().abs(), weight.double().abs(), block_max(x), block_max(weight)
    sums = gamma(x.shape[-1] // group + 2) * ((x_abs + e_x * x_max) @ (w_abs + e_w * w_max).T)
    return e_w * (x_abs @ w_max.T) + e_x * (x_max @ w_abs.T) + e_w * e_x * (x_max @ w_max.T) + sums


def log_softmax_error(n: int, z_max: float, z_error: float = 0.0, dtype: torch.dtype = torch.float32) -> float:
    """A bound on |fl(log_softmax(z)) - log_softmax(z)| for z of n entries, |z| <= z_max, each off by <= z_error:
    logsumexp = m + log sum exp(z - m) errs by z_error plus its sum's relative error (n exps, each rounded, then
    n - 1 adds: gamma_{2n}) plus the roundings of z - m, the log, + m and the final subtraction, each at most u times
    a magnitude <= 2 z_max + log n; the entry itself errs by z_error."""
    return 2 * z_error + gamma(2 * n, dtype) + 4 * unit_roundoff(dtype) * (2 * z_max + math.log(n))


def softmax_error(n: int, z_max: float, z_error: float = 0.0, dtype: torch.dtype = torch.float32) -> float:
    """The relative error of each probability of a softmax over n entries (|z| <= z_max, each off by <= z_error),
    however it is formed (exp(z - m) / sum, or exp of a log-softmax): e^delta - 1 for delta the log-softmax bound."""
    return math.expm1(log_softmax_error(n, z_max, z_error, dtype))


def sigmoid_error(x_error: float, dtype: torch.dtype = torch.float32) -> float:
    """sigmoid is 1/4-Lipschitz; its own evaluation (exp, add, divide) adds at most gamma_3 of a value <= 1."""
    return x_error / 4 + gamma(3, dtype)


def rope_inv_freq_error(theta: float) -> float:
    """One float32 computation's relative error in RoPE's inverse frequencies: theta ** (2i / d) with the exponent
    rounded (relative u there is ln(theta) u in the power), the power itself (libm, <= 1 ulp: 2 u), then at most 12
    more roundings (1 / p, a scaling's divide, ramp, blend or smoothing, whose weights are <= 1)."""
    return gamma(math.ceil(math.log(theta)) + 14)


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor | float, msg: str = "") -> None:
    """|actual - expected| <= bound elementwise (a tensor bound broadcasts), compared in float64."""
    assert actual.shape == expected.shape, (msg, actual.shape, expected.shape)
    diff = (actual.double() - expected.double()).abs()
    excess = diff - torch.as_tensor(bound, dtype=torch.float64)
    if bool((excess <= 0).all()):
        return
    worst = int(excess.argmax())
    limit = diff.flatten()[worst] - excess.flatten()[worst]
    raise AssertionError(f"{msg + ': ' if msg else ''}{int((excess > 0).sum())} of {diff.numel()} elements exceed "
                         f"their bound; worst |diff| {diff.flatten()[worst]:.3g} > bound {limit:.3g}")


def _block_chain(c, layer: int, context: int) -> int:
    """A block's roundings: the input norm's sum of squares (d), the projection in (d, + 1 with a bias), the sequence
    mixing, the projection out, the residual add, the second norm (d), gate/up (d), down (intermediate), the add.
    Softmax attention: the q/k norms (head_dim), the score (head_dim), softmax's sum and P V (context each). A Gated
    DeltaNet layer: conv (kernel), the q/k l2 norms (key dim), then `context` recurrent rank-1 updates, each through
    two key-dim dot products (state k, state q) and three scalings, then its gated norm (value dim)."""
    d = c.hidden_size
    if getattr(c, "is_linear", None) is not None and c.is_linear(layer):
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        mixing = c.linear_conv_kernel + dk + context * (2 * dk + 3) + dv + c.linear_num_value_heads * dv
    else:
        mixing = 2 * c.head_dim + 2 * context + c.num_heads * c.head_dim
    return d + (d + 1) + mixing + 1 + d + d + c.intermediate_size + 1


def chain_length(config, context: int, layers: int | None = None) -> int:
    """Roundings on the longest chain from the embeddings through the first `layers` blocks (a hidden state), or,
    by default, through every block, the final norm and the LM head (the logits), attending over `context` rows.
    `config`: a target's ModelConfig, or a drafter's DrafterConfig (see `drafter_chain_length`)."""
    n = sum(_block_chain(config, i, context) for i in range(config.num_layers if layers is None else layers))
    return n + (2 * config.hidden_size if layers is None else 0)


def drafter_chain_length(config, context: int, layers: int | None = None) -> int:
    """A drafter's chain: its context rows come through fc (the target features, m x target_hidden long) and the
    hidden norm (d) before its blocks' keys and values read them."""
    fc = len(config.target_layer_ids) * config.target_hidden_size + config.hidden_size
    return fc + chain_length(config, context, layers)


def logit_scale(head_weight: torch.Tensor, norm_weight: torch.Tensor) -> float:
    """S = sqrt(d) max_j ||W_j * g||_2: bounds every logit and every partial sum of its terms."""
    g = norm_weight.detach().double()
    return math.sqrt(g.numel()) * float((head_weight.detach().double() * g).norm(dim=1).max())


def model_logit_scale(model) -> float:
    """`logit_scale` of a runtime Transformer (its LM head, or the tied embedding) or Drafter (lm_head)."""
    if hasattr(model, "tok_embeddings"):
        head = model.tok_embeddings.weight if model.output is None else model.output.weight
    else:
        head = model.lm_head.weight
    return logit_scale(head, model.norm.weight)


def row_scale(hidden: torch.Tensor) -> float:
    """The largest 2-norm of a hidden state's rows [..., d]: the scale of its elements' errors."""
    return float(hidden.detach().double().norm(dim=-1).max())


def network_tolerance(chain: int, scale: float, dtype: torch.dtype = torch.float32, sides: int = 2) -> float:
    """sides * AMPLIFICATION * chain_gamma(chain) * scale: how far `sides` computations of a network output in
    `dtype` (different orders, implementations, CPUs) can be apart (sides=2) or from the exact value (sides=1)."""
    return sides * AMPLIFICATION * chain_gamma(chain, dtype) * scale


def logits_tolerance(model, context: int, sides: int = 2) -> float:
    """`network_tolerance` of a float32 runtime Transformer's logits over `context` rows."""
    return network_tolerance(chain_length(model.config, context), model_logit_scale(model), sides=sides)


def hidden_tolerance(config, context: int, layers: int | None, hidden: torch.Tensor, sides: int = 2) -> float:
    """`network_tolerance` of a float32 hidden state after `layers` blocks (None: the final normed one), scaled by
    its rows' 2-norms."""
    return network_tolerance(chain_length(config, context, layers), row_scale(hidden), sides=sides)
