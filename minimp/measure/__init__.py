"""minimp.measure: what training costs, measured and by formula.

Bytes held and sent by each strategy beside the formulas they are checked against (accounts,
tensor_parallel_accounts), the alpha-beta cost model and the machine model fitted on this
project's machine (costmodel, machinemodel, calibrate), and timelines in the Chrome trace format
(trace). The strategies record into these meters; the meters never run a strategy.
"""
