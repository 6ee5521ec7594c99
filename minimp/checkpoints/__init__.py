"""minimp.checkpoints: what every command that reads or writes a run's files shares.

Reading, writing and validating checkpoints (checkpoint), files written atomically and output paths
checked before any work (files), and the errors a user can fix (errors). `minimp.train`,
`minimp.sample` and `minimp.export` import this, and nothing else of each other.
"""
