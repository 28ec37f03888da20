"""``python -m shardwise.validate``: the same as ``shardwise validate``."""

import sys

from shardwise.validate.command import main

sys.exit(main())
