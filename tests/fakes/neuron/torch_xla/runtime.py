"""The fake torch_xla.runtime: the process layout from the launcher's environment."""

import os


def device_type():
    return os.environ.get("PJRT_DEVICE") or None


def world_size():
    return int(os.environ.get("WORLD_SIZE", "1"))


def global_ordinal():
    return int(os.environ.get("RANK", "0"))


def local_ordinal():
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_spmd():
    return False
