"""The tables of benchmarks/cluster.py (its rows, ratios, columns and notes), apart from the
launches that measure them."""

from __future__ import annotations

from _common import GB

MIB = 1 << 20


def _trace_rows(rows: list[dict]) -> list[dict]:
    """Where (a)'s seconds go, per N (the raw ceiling's and shardwise's fastest launch; the
    slowest rank of each): when the first GET and the first data GET left, when the node's NIC
    had received 1% and 99% of its bytes, its rate in between, the exchange's all_to_all seconds
    (blocking the main thread; the fetches go on behind it) and the tail after the NIC's 99%."""
    out = []
    for row in rows:
        ranks = row.get("per_rank") or []
        if row["case"] != "a" or not row["method"].startswith(("raw ceiling", "shardwise")) or not ranks:
            continue
        slow = max(ranks, key=lambda r: r["seconds"])
        t = slow.get("trace") or {}
        out.append({"method": row["method"], "network": row.get("network"), "nodes": row["nodes"],
                    "seconds": slow["seconds"],
                    "first_get_s": t.get("first_get_s"), "first_data_get_s": t.get("first_data_get_s"),
                    "rx_start_s": t.get("rx_start_s"), "rx_end_s": t.get("rx_end_s"),
                    "rx_rate_mbit": t.get("rx_rate_mbit"), "gets": t.get("gets"),
                    "gets_small": t.get("gets_under_1mib"), "get_median_mib": t.get("get_median_mib"),
                    "server_busy": row.get("weed_busy"),
                    "rx_mib": slow["nic"].get("rx_bytes", 0) / MIB, "share_mib": slow["share"] / MIB,
                    "a2a": t.get("a2a"), "a2a_s": t.get("a2a_s"),
                    "tail_s": slow["seconds"] - t["rx_end_s"] if t.get("rx_end_s") is not None else None,
                    "cpu_busy": slow["cpu_busy"]})
    return out


TRACE_COLUMNS = [("method", "method"), ("network", "collectives over"), ("nodes", "nodes"),
                 ("seconds", "load s"),
                 ("first_get_s", "1st GET s"), ("first_data_get_s", "1st data GET s"),
                 ("rx_start_s", "NIC 1% s"), ("rx_end_s", "NIC 99% s"),
                 ("rx_rate_mbit", "NIC Mbit/s between"),
                 ("rx_mib", "node rx MiB"), ("share_mib", "share MiB"), ("gets", "GETs"),
                 ("gets_small", "GETs < 1 MiB"), ("get_median_mib", "GET median MiB"),
                 ("a2a", "all_to_alls"), ("a2a_s", "all_to_all s"), ("tail_s", "after NIC 99% s"),
                 ("cpu_busy", "CPU busy"), ("server_busy", "S3 server CPU busy")]


def _ratios(rows: list[dict]) -> None:
    by = {(r["case"], r["method"], r["nodes"]): r for r in rows if "seconds" in r}
    for row in rows:
        for key, base in (("x_raw", "raw ceiling"), ("x_runai_dist", "runai distributed")):
            other = by.get((row["case"], base, row["nodes"]))
            if "seconds" in row and other:
                row[key] = other["seconds"] / row["seconds"]


def _save_rows(rows: list[dict], total: int) -> list[dict]:
    out = []
    for row in rows:
        ranks = row.get("per_rank") or []
        if not ranks or "saves" not in ranks[0]:
            continue
        for kind in ("gather", "distributed"):
            count = range(len(ranks[0]["saves"][kind]))
            raw = min(max(r["saves"][f"raw {kind}"][i]["seconds"] for r in ranks) for i in count)
            ours = min(max(r["saves"][kind][i]["seconds"] for r in ranks) for i in count)
            busy = max(r["saves"][kind][i]["cpu_busy"] for r in ranks for i in count)
            tx = max(r["saves"][kind][i]["nic"].get("tx_bytes", 0) for r in ranks for i in count)
            n = row["nodes"]
            out += [{"method": f"raw put ({kind})", "nodes": n, "seconds": raw, "gbps": total / raw / GB},
                    {"method": f"sw.save {kind}", "nodes": n, "seconds": ours, "gbps": total / ours / GB,
                     "x_raw": raw / ours, "cpu_busy": busy, "node_tx_mib": tx / MIB}]
    return out


COLUMNS = [("case", "case"), ("method", "method"), ("network", "collectives over"), ("nodes", "nodes"),
           ("ranks", "ranks"),
           ("seconds", "load s"), ("gbps", "GB/s job"), ("x_raw", "speed ÷ raw ceiling"),
           ("x_runai_dist", "speed × runai dist"),
           ("store_sent_x", "store sent ÷ ckpt"), ("node_rx_mib", "node rx MiB (max)"),
           ("fabric_rx_mib", "node fabric rx MiB (max)"), ("cpu_busy", "CPU busy (max rank)"),
           ("weed_busy", "S3 server CPU busy"), ("load", "load avg"), ("note", "note")]
SAVE_COLUMNS = [("method", "method"), ("nodes", "nodes"), ("seconds", "s"), ("gbps", "GB/s"),
                ("x_raw", "speed ÷ raw ceiling"), ("node_tx_mib", "node tx MiB (max)"),
                ("cpu_busy", "CPU busy (max rank)")]


def _notes(payload: dict) -> str:
    a = payload["args"]
    return (f"A simulated cluster on this one machine (shardwise.testing.cluster): each node a network "
            f"namespace whose NIC is a veth at {a['mbit']} Mbit/s each way (tc tbf, a queue of 250 ms), "
            f"the storage host SeaweedFS's S3 gateway (unlimited in (a), {a['store_mbit']} Mbit/s in (b)), "
            f"torchrun with c10d rendezvous over the nodes. Checkpoint {payload['total_bytes'] / GB:.3f} GB "
            f"bf16 in {payload['files']} files (benchmarks/_common.py's Llama-like stack, every tensor but "
            f"the norms split by the toy's tp plan). (a): tp over the nodes, one rank per node; (b): "
            f"mesh(dp_replicate=N, tp=2), two ranks per node. Methods and counters: the script's docstring. "
            f"Speed ratios divide the baseline's seconds by this row's; store sent = bytes the storage "
            f"host's NIC sent during the launch ÷ the checkpoint. Goals: (a) ≥ 0.85 of the raw ceiling, "
            f"≥ N × runai's distributed mode; (b) store sent ≤ 1.05. Command: {payload['command']}."
            + (f" Each node also on a back-end fabric at {a['fabric_mbit']:g} Mbit/s each way (a second veth "
               f"and bridge; the storage host is not on it): `collectives over` says whether the launch's "
               f"torchrun and gloo used it or the shared NIC; `load avg`: the machine's 1-minute load "
               f"average after the launch (2 cores, shared with other jobs: noisy)."
               if a.get("fabric_mbit") else ""))
