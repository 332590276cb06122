"""Operator implementations the solver can choose per Op (docs/impls.md).

    relu_mask        ReLU whose backward holds a 1-bit mask instead of its output
    bn_relu_lean     BatchNorm(train) + in-place ReLU holding only the BN input
    hardtanh_mask    hardtanh / ReLU6 whose backward holds a 1-bit mask instead of its input
    bn_hardtanh_lean BatchNorm(train) + in-place hardtanh / ReLU6 holding only the BN input
    maxpool_compact  MaxPool2d holding a 4-bit in-window argmax (int8 if area > 16), not its input
    dropout_regen    Dropout regenerating its mask from the saved RNG state in the backward
    recompute_internals  MultiheadAttention, scaled_dot_product_attention, RNNs and Transformer
                     layers holding only their inputs, their forward run again in the backward
    sdpa_mask        scaled_dot_product_attention with dropout on the CPU holding its inputs and a
                     1-byte dropout mask; the backward recomputes the probabilities, draws nothing
    sdpa_probs_mask  the same holding the probabilities too; the backward rebuilds only the noise
    conv_split, linear_split   a convolution / linear layer whose backward makes the weight
                     gradient, lets the input go, then makes the input gradient
    conv_split_mask, linear_split_mask   the same with the Op's in-place ReLU / hardtanh masked
    relu_inplace, sigmoid_inplace, add_inplace, add_inplace_rhs
                     an op written out of place (ReLU, sigmoid/tanh, a + b) run in place, its
                     output taking the storage of an input nothing reads afterwards
"""

from .registry import ImplSpec, SubstitutingMixin, get, matches, names, register, specs

# The families register themselves on import. The import order is the registration order, i.e.
# the order of an Op's extra Impls (part of a graph's fingerprint): do not reorder.
from . import dropout, pool, relu, hardtanh, internals, inplace, split, attention  # noqa: E402,F401

__all__ = ["ImplSpec", "SubstitutingMixin", "get", "matches", "names", "register", "specs"]
