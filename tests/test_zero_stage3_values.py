"""ZeRO stage 3's ParameterGatherer on one layer: the gathered unit is freed after the forward
(the graph keeps a note of where the weight lay, not the weight), and backward rebuilds it; an
output made under no_grad gathers nothing, whatever backward later reaches it."""

import gc
import weakref

import numpy as np

from minimp import Tensor, nn
from minimp import distributed as dist
from minimp.optim import SGD
from minimp.parallel.zero.data_parallel import zero_data_parallel
from minimp.tensor import no_grad


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


def _backward_into_an_output_made_without_grad(comm):
    """(the units gathered, the holds) after a backward reaches, as a leaf, an output the gatherer
    made under no_grad."""
    layer = nn.Linear(3, 2, rng=np.random.default_rng(5))
    gatherer = zero_data_parallel(3, SGD(layer.parameters(), lr=0.1), [layer], comm).gatherer
    with no_grad():  # an evaluation: no graph, so no backward to gather the unit for
        y = gatherer.run([layer], Tensor(np.ones((4, 3), np.float32)),
                         lambda layers, inputs: layers[0](inputs))
    y.requires_grad = True  # made a leaf of a graph of its own (say, to probe the outputs)
    (y * y).sum().backward()
    return gatherer.arrays_by_kind()["gathered"], gatherer.holds


def test_a_backward_reaching_an_output_made_without_grad_gathers_nothing():
    """The gatherer hooks an output's backward only when the layers made a graph; a hook left on
    an output of no_grad would gather its units for a backward of the layers that never comes,
    and keep them gathered, held, until an after_backward releases the holds."""
    gathered, holds = dist.simulate(1, _backward_into_an_output_made_without_grad)[0]
    assert gathered == [] and holds == [0]
