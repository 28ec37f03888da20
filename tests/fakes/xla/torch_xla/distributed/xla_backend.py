"""The fake "xla" process group and the xla:// init method; importing registers both, as the
real module does.

The rendezvous is torch_xla 2.9's: rank and world come from the runtime (``xr.global_ordinal()``,
``xr.world_size()``), not from RANK/WORLD_SIZE; under torchrun (``TORCHELASTIC_USE_AGENT_STORE``)
it joins the agent's store as a client, elsewhere ordinal 0 hosts a TCPStore on MASTER_PORT
(default 12355). So under torchrun on PJRT CPU every process is rank 0 of a world of one.
"""

import os
import sys
from datetime import timedelta

import torch.distributed as dist

import torch_xla.runtime as xr
from fakes.device.groups import register_xla_group


def _rendezvous(url, timeout=timedelta(minutes=5), **kwargs):
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "12355"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        store = dist.PrefixStore(f"/worker/attempt_{attempt}",
                                 dist.TCPStore(host, port, xr.process_count(), False, timeout))
    else:
        store = dist.TCPStore(host, port, xr.process_count(), xr.global_ordinal() == 0, timeout)
    yield store, xr.global_ordinal(), xr.world_size()


def new_xla_process_group(ranks=None, timeout=None, backend=None, pg_options=None):
    return dist.new_group(ranks, backend="xla")


register_xla_group()
if "xla" not in sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers:
    dist.register_rendezvous_handler("xla", _rendezvous)
