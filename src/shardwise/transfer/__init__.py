"""Weights from one layout to another, in memory: ``sw.transfer_plan(src, dst)`` once, then
``plan.run()`` every step (``run.py``); the plan itself is pure data (``plan.py``, which also prints
it) and computable offline from degrees (``offline.py``)."""

from shardwise.transfer.offline import MeshLayout, offline_plan
from shardwise.transfer.plan import Plan, by_link, rank_loads
from shardwise.transfer.run import TransferPlan, transfer_plan

__all__ = ["MeshLayout", "Plan", "TransferPlan", "by_link", "offline_plan", "rank_loads", "transfer_plan"]
