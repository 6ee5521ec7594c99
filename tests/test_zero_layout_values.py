"""reachable_parameters by value: every Parameter a module can read, each once, in a module graph
with a cycle (a layer that keeps a reference to its parent) as well as a shared one."""

import signal

import numpy as np

from minimp import nn
from minimp.nn.module import reachable_parameters


def within(seconds, fn):
    """fn(); a failure if it runs past `seconds` (a visit that never ends must fail, not hang)."""

    def too_slow(signum, frame):
        raise TimeoutError(f"did not finish within {seconds} s")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        outcome = fn()
    except TimeoutError:  # raised deep in the loop: reported from here, where pytest can show it
        outcome = TimeoutError
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert outcome is not TimeoutError, f"did not finish within {seconds} s"
    return outcome


def test_a_module_graph_with_a_cycle_is_visited_once_and_ends():
    """The parent holds the child, and the child keeps its parent (unregistered, as the GPT's
    head keeps the token embedding): the visit must remember what it has seen or go round."""
    parent, child = nn.Module(), nn.Module()
    parent.weight = nn.Parameter(np.ones(2, np.float32))
    child.bias = nn.Parameter(np.zeros(3, np.float32))
    parent.child, child.owner = child, parent
    found = within(2.0, lambda: reachable_parameters(parent))
    assert [p.shape for p in found] == [(2,), (3,)]


def test_a_module_seen_twice_does_not_end_the_visit_of_the_others():
    """The same module held twice comes off the stack a second time while another module still
    waits under it: the visit skips the copy and goes on to that one."""
    top, first, shared = nn.Module(), nn.Module(), nn.Module()
    first.weight = nn.Parameter(np.ones(2, np.float32))
    shared.bias = nn.Parameter(np.zeros(3, np.float32))
    top.first, top.shared, top.again = first, shared, shared  # the stack: first, shared, shared
    found = within(2.0, lambda: reachable_parameters(top))
    assert {id(p) for p in found} == {id(first.weight), id(shared.bias)} and len(found) == 2


def test_a_shared_module_s_parameters_are_listed_once():
    shared = nn.Module()
    shared.weight = nn.Parameter(np.ones(4, np.float32))
    top, left, right = nn.Module(), nn.Module(), nn.Module()
    left.shared, right.shared = shared, shared
    top.left, top.right = left, right
    found = within(2.0, lambda: reachable_parameters(top))
    assert len(found) == 1 and found[0] is shared.weight
