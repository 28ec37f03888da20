"""``shardwise demo``: a local multi-rank run on gloo, printed as a table."""

from __future__ import annotations

from shardwise.launch import spawn


def _rank_info() -> dict:
    import shardwise as sw

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=backend.world_size)
    return {"rank": backend.rank, "world": backend.world_size, "backend": backend.name,
            "device": str(backend.device), "mesh": f"{mesh.mesh_dim_names}={tuple(mesh.shape)}"}


def run_demo(*, tp: int = 4, size: str = "small", keep: str | None = None) -> int:
    rows = spawn(_rank_info, tp, timeout=120)
    print(f"{'rank':>4}  {'world':>5}  {'backend':<8} {'device':<8} mesh")
    for r in rows:
        print(f"{r['rank']:>4}  {r['world']:>5}  {r['backend']:<8} {r['device']:<8} {r['mesh']}")
    return 0
