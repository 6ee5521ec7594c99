"""The README's Python example runs as printed."""

import os
import re

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def test_every_python_block_in_the_readme_runs():
    blocks = re.findall(r"```python\n(.*?)```", open(README).read(), flags=re.S)
    assert blocks, "the README shows the library API in at least one python block"
    for block in blocks:
        namespace = {}
        exec(compile(block, "README.md", "exec"), namespace)
        if "result" in namespace:  # the mixed-precision example ends in a StepResult
            assert namespace["result"].loss_scale == 2.0**16
