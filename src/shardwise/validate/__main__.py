"""``python -m shardwise.validate``: the same as ``shardwise validate``."""

import sys

from shardwise.validate import main

sys.exit(main())
