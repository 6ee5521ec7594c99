"""Expert parallelism (--ep): the E experts of every mixture split over ep data-parallel ranks,
tokens sent to the ranks holding their experts and back by two all-to-alls (dispatch.py); which
rank holds which expert and what it keeps (layout.py); the expert gradients' own reduction
(grads.py)."""

from minimp.parallel.expert.dispatch import (DispatchCounts, ExpertParallelDispatch,
                                             dispatch_bytes)
from minimp.parallel.expert.grads import ExpertGradients
from minimp.parallel.expert.layout import (expert_index, held_parameters, local_experts,
                                          memory_by_kind, zero_bytes_sent)
