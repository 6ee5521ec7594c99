"""minimp/train/checks.py's companions: a flag that acts only beside another (the mixture's beside
--experts, the context split's beside --cp) is refused in one line when moved from its default
without it, since it would do nothing; at its default, or with its companion, it passes."""

import pytest

from minimp.checkpoints.errors import ConfigError
from minimp.train.checks import COMPANIONS
from minimp.train.cli import parse_config

MOVED = {"top_k": "1", "capacity_factor": "1.5", "aux_loss_coef": "0", "router_z_loss_coef":
         "0.001", "expert_hidden": "64", "cp_layout": "contiguous", "cp_mode": "ulysses"}
COMPANION_FLAGS = {"--experts E": ["--experts", "4", "--dp", "2"], "--cp N": ["--cp", "2"]}


@pytest.mark.parametrize("name, needed", [(name, needed) for names, needed, _ in COMPANIONS
                                          for name in names])
def test_a_flag_without_its_companion_is_refused_and_with_it_passes(name, needed):
    option = "--" + name.replace("_", "-")
    config = parse_config(["--dataset", "shakespeare", option, MOVED[name]], quiet=True)
    with pytest.raises(ConfigError, match=f"^{option} .* does nothing without {needed}") as error:
        config.validate(2)
    assert "\n" not in str(error.value)
    extra = ["--cp-layout", "contiguous"] if name == "cp_mode" else []  # Ulysses' layout
    config = parse_config(["--dataset", "shakespeare", option, MOVED[name], *extra,
                           *COMPANION_FLAGS[needed]], quiet=True)
    config.validate(2)  # with its companion: accepted
    parse_config(["--dataset", "shakespeare"], quiet=True).validate(2)  # the defaults pass
