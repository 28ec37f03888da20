"""The fake "xla" process group: gloo under another name, and the xla:// init method.

Like the real module, importing it registers both; the init method reads the launcher's
environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), as torch_xla's does under torchrun.
"""

import os
from datetime import timedelta

import torch.distributed as dist


def _create(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _rendezvous(url, timeout=timedelta(minutes=5), **kwargs):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0, timeout=timeout)
    yield store, rank, world


def new_xla_process_group(ranks=None, timeout=None, backend=None, pg_options=None):
    return dist.new_group(ranks)


if "xla" not in dist.Backend.backend_list:
    dist.Backend.register_backend("xla", _create, devices=["cpu"])
    dist.register_rendezvous_handler("xla", _rendezvous)
