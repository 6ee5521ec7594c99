"""ZeRO stage 3's ParameterGatherer on one layer: the gathered unit is freed after the forward
(the graph keeps a note of where the weight lay, not the weight), and backward rebuilds it."""

import gc
import weakref

import numpy as np

from minimp import Tensor, nn
from minimp import distributed as dist
from minimp.optim import SGD
from minimp.parallel.zero.data_parallel import zero_data_parallel


def _forward_and_backward(comm):
    """(was the gathered unit still alive after the forward?, x's gradient, the weight)."""
    layer = nn.Linear(3, 2, rng=np.random.default_rng(5))
    weight = layer.weight.data.copy()  # float32: the compute copy is the master's bits
    sync = zero_data_parallel(3, SGD(layer.parameters(), lr=0.1), [layer], comm)
    gatherer = sync.gatherer
    gathered = []  # a weak reference to each unit array the gatherer makes
    gatherer.sample = lambda: gathered.append(weakref.ref(gatherer.flats[0]))
    x = Tensor(np.arange(12, dtype=np.float32).reshape(4, 3), requires_grad=True)
    y = gatherer.run([layer], x, lambda layers, inputs: layers[0](inputs))
    gc.collect()
    kept_alive = gathered[0]() is not None
    y.backward(np.ones((4, 2), np.float32))
    gatherer.release_holds()
    return kept_alive, x.grad, weight


def test_the_forward_s_gathered_unit_is_freed_and_backward_gathers_it_again():
    """Linear saves its weight for backward; under the gatherer's hooks it saves where the weight
    lay instead, so nothing holds the gathered unit once the forward is done. A weight saved as it
    is would keep the whole unit alive until backward: stage 3's memory saving lost."""
    kept_alive, grad_x, weight = dist.simulate(1, _forward_and_backward)[0]
    assert not kept_alive
    # dL/dx = dL/dy @ W with dL/dy all ones: each row is the column sums of W.
    np.testing.assert_array_equal(grad_x, np.tile(weight.sum(axis=0), (4, 1)))
