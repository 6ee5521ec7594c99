"""minimp.nn: modules (as torch.nn): Parameter and Module, the layers MLPs and GPTs are built from,
dropout with masks every parallel layout draws alike, activation recomputation, and fp8 Linears."""

from minimp.nn.fp8 import enable_fp8, fp8_metas, fp8_quantizers, fp8_state_dict, load_fp8_state_dict
from minimp.nn.layers import GELU, Embedding, LayerNorm, Linear, ReLU, Sequential, Tanh
from minimp.nn.layers import Dropout, DropoutState, set_dropout_state  # and the state of its masks
from minimp.nn.module import Module, Parameter
from minimp.nn.recompute import Recompute, recompute
