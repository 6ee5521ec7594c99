"""The op list: one Function per differentiable operation, forward and backward side by side."""

from minimp.ops.attention import TiledAttention
from minimp.ops.dropout import Dropout
from minimp.ops.elementwise import GELU, Add, Cast, Div, Exp, Log, Mul, Neg, ReLU, Sub, Tanh
from minimp.ops.embedding import Embedding
from minimp.ops.index_add import IndexAdd
from minimp.ops.linalg import BlockScaledLinear, Fp8Linear, Linear, MatMul
from minimp.ops.reduce import LayerNorm, Mean, Sum
from minimp.ops.shape import BasicIndex, Index, Reshape, Transpose
from minimp.ops.softmax import CrossEntropy, LogSoftmax, ScaledMaskedSoftmax, Softmax
