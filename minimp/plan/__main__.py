"""`python -m minimp.plan`: runs the planner's command line (minimp/plan/cli.py)."""

import sys

from minimp.plan.cli import main

sys.exit(main())
