"""``python -m asyncrl.launch CONFIG [overrides]``: the same as ``asyncrl-launch``."""

import sys

from asyncrl.launch.local import main

sys.exit(main())
