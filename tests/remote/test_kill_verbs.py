"""kill -9 during every kind of save to an object store through the public verbs: ``sw.save``
(gather, several files), ``sw.save(distributed=True)`` and ``sw.save_optimizer``, each by two
gloo ranks at tp=2 in a saving subprocess behind its own proxy, SIGKILLed (the whole group, or
one rank) once a given number of its requests have passed. A checkpoint of the same kind is at
the prefix before; afterwards the prefix loads as that one or the new one, whole (every tensor
of one of them, never a mix), and the next save to the prefix completes, loads, and leaves
nothing staged. test_kill.py does the same below the verbs, for the storage's own transaction."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote

import pytest
import torch
from proxy import Proxy
from test_optimizer_remote import _same, _state, _stepped
from test_publish import _left

import shardwise as sw
from models import make_model, tiny_plan
from shardwise.io.storage.lookups import PUBLISH_MARK
from shardwise.parallel import get_shard_state, local_of
from shardwise.testing import spawn

HERE = Path(__file__).parent
PYTHONPATH = os.pathsep.join(str(p) for p in (HERE.parents[1] / "src", HERE.parent, HERE))
SHARD_SIZE = 40_000  # the gather save writes several files and an index
TIMEOUT = 20.0  # the ranks' collective timeout: a rank whose peer died ends within it

# (requests through the saver's proxy before the kill, who is killed), spread over each kind's
# save. Of the gather save's ~35 requests (s3 and gs alike), the staging PUTs are about the 4th to
# the 11th, the journal the 12th, then the copies, then the deletes; of a DCP save's ~32, the
# staging PUTs the 12th to 15th, the journal the 17th. "rank 1" leaves rank 0 running until the
# launcher stops it, as torchrun would.
POINTS = {
    "gather": [(6, "all"), (16, "all"), (26, "rank 1")],
    "distributed": [(12, "rank 1"), (18, "all"), (24, "all")],
    "optimizer": [(6, "all"), (14, "rank 1"), (21, "all")],
}


def _save(kind: str, model, url: str, seed: int, options: dict) -> None:
    """The verb ``kind`` names, over ``model`` (the optimizer: a step of Adam on it by ``seed``)."""
    if kind == "gather":
        sw.save(model, url, max_shard_size=SHARD_SIZE, overwrite=True, storage_options=options)
    elif kind == "distributed":
        sw.save(model, url, distributed=True, overwrite=True, storage_options=options)
    else:
        state = get_shard_state(model)
        optimizer = _stepped(model, state.degree, state.tp_rank, seed=seed + 100, lr=0.001 * seed)
        sw.save_optimizer(model, optimizer, url, overwrite=True, storage_options=options)


def _model(mesh, seed: int):
    model = make_model(seed)
    sw.parallelize(model, tiny_plan(), mesh, holding="local")
    return model


def saving_rank(kind: str, url: str, seed: int, options: dict, pids: str) -> str:
    """One rank of the killed save (spawned by the saver subprocess)."""
    backend = sw.init_backend("gloo", timeout=TIMEOUT)
    Path(pids, f"rank{backend.rank}").write_text(str(os.getpid()))
    _save(kind, _model(backend.mesh(tp=2), seed), url, seed, options)
    return "saved"


def _which(kind: str, mesh, url: str, options: dict, seeds: tuple[int, ...]) -> int | str:
    """The seed whose checkpoint the prefix holds, every tensor of it; else a description."""
    if kind == "optimizer":
        model = _model(mesh, 0)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
        sw.load_optimizer(model, optimizer, url, storage_options=options)
        got = {**_state(optimizer), "lr": torch.tensor(optimizer.param_groups[0]["lr"])}
        wants = {}
        for seed in seeds:
            reference = _stepped(_model(mesh, 0), 1, 0, seed=seed + 100, lr=0.001 * seed)
            wants[seed] = {**_state(reference), "lr": torch.tensor(reference.param_groups[0]["lr"])}
    else:
        with torch.device("meta"):
            model = make_model()
        sw.load(model, url, plan=tiny_plan(), mesh=mesh, storage_options=options)
        got = {n: local_of(t).detach() for n, t in model.state_dict(keep_vars=True).items()}
        wants = {seed: make_model(seed).state_dict() for seed in seeds}
    for seed, want in wants.items():
        if got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want):
            return seed
    return {seed: sorted(str(k) for k in want if k in got and not _same(got[k], want[k]))[:5]
            for seed, want in wants.items()}.__repr__()


def checking_rank(kind: str, url: str, options: dict, seeds: tuple[int, ...], then: int | None):
    """What the prefix holds (``_which``; nothing asked without ``seeds``), after which a save
    of ``then`` (if any) completes and loads as itself."""
    backend = sw.init_backend("gloo", timeout=TIMEOUT)
    mesh = backend.mesh(tp=1)
    found = _which(kind, mesh, url, options, seeds) if seeds else None
    if then is not None:
        _save(kind, _model(mesh, then), url, then, options)
        assert _which(kind, mesh, url, options, (then,)) == then
    return found


def _env(remote, proxy: Proxy) -> dict:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    if remote.scheme == "gs":
        env["STORAGE_EMULATOR_HOST"] = proxy.endpoint
    return env


SAVER = """
import json, os, sys
from shardwise.testing import spawn
from test_kill_verbs import saving_rank
kind, url, seed, options, pids = json.loads(sys.argv[1])
env = {k: os.environ[k] for k in ("STORAGE_EMULATOR_HOST",) if k in os.environ}
print(spawn(saving_rank, 2, args=(kind, url, seed, options, pids), env=env, timeout=240), flush=True)
"""


def _killed_save(remote, kind: str, url: str, seed: int, after: int, victim: str,
                 pids: Path) -> tuple[int, bool]:
    """Run the save of ``seed`` in a subprocess, kill it (``victim``) once ``after`` requests
    reached its own proxy, and wait until what it had sent has landed; the requests seen then,
    and whether the store took the publish journal (the instant the new checkpoint is whole)."""
    proxy = Proxy(remote.server.endpoint, host=remote.proxy.host_mode, gcs_put=remote.proxy.gcs_put)
    options = {**remote.options, **({"endpoint": proxy.endpoint} if remote.scheme == "s3" else {})}
    for old in pids.glob("rank*"):
        old.unlink()
    saver = subprocess.Popen([sys.executable, "-c", SAVER, json.dumps([kind, url, seed, options, str(pids)])],
                             env=_env(remote, proxy), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)  # its own process group: the ranks with it
    deadline = time.monotonic() + 240
    while len(proxy.requests) < after and saver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    seen = len(proxy.requests)
    try:
        if victim == "all":
            os.killpg(saver.pid, signal.SIGKILL)
        else:
            while not (pids / "rank1").exists() and saver.poll() is None:
                time.sleep(0.01)  # it writes its pid on joining the group, before any request
            os.kill(int((pids / "rank1").read_text()), signal.SIGKILL)
    except ProcessLookupError:  # it had ended: the save finished, which the assert below reports
        pass
    output = saver.communicate(timeout=120)[0].decode(errors="replace")
    try:
        os.killpg(saver.pid, signal.SIGKILL)  # what the launcher may have left (its forkserver)
    except ProcessLookupError:
        pass
    assert saver.returncode != 0, f"the save finished before its kill at {after}: raise no point past " \
                                  f"{seen} requests\n{output[-2000:]}"
    proxy.settle()  # what the dead ranks had sent lands (or not) before the prefix is read
    proxy.close()
    journal = [r for r in proxy.requests if r.method == "PUT" and PUBLISH_MARK in unquote(r.path)]
    return seen, any(r.status == 200 for r in journal)


@pytest.mark.parametrize("kind", list(POINTS))
def test_a_killed_save_through_the_verbs_leaves_a_whole_checkpoint(remote, tmp_path, kind):
    url = remote.url("ckpt").rstrip("/")
    options = remote.options
    env = {k: os.environ[k] for k in ("STORAGE_EMULATOR_HOST",) if k in os.environ}
    assert spawn(checking_rank, 1, args=(kind, url, options, (), 1), env=env, timeout=240) == [None]
    previous, outcomes = 1, []
    for i, (after, victim) in enumerate(POINTS[kind]):
        new, then = 10 + i, 20 + i
        seen, published = _killed_save(remote, kind, url, new, after, victim, tmp_path)
        found = spawn(checking_rank, 1, args=(kind, url, options, (previous, new), then), env=env,
                      timeout=240)[0]
        outcomes.append((after, seen, published, found))
        assert found == (new if published else previous), (kind, victim, outcomes)
        previous = then  # the next point's previous checkpoint: the save that followed this one
    # the points fell on both sides of the journal: old checkpoints kept and new ones published
    assert {p for _, _, p, _ in outcomes} == {True, False}, outcomes
    left = _left(remote)
    assert left and all(n.startswith("ckpt/") for n in left), left  # no staging prefix, no journal
