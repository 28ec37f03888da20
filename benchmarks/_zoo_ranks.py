"""The zoo's rank side: one pair (or group) of gloo ranks that loads family after family.

``RankPool`` starts ``tp`` rank processes once; the parent hands every rank the same
``(family, tool)`` task and waits for all of them before the next one, so a tool that fails
on one rank never leaves another rank's collective waiting on the next task. A task that
runs past its time limit, a rank that dies, or a collective that fails restarts the ranks
(the process group is suspect then) and the sweep goes on with the next task.

Each task, on each rank: build the model (``shardwise``: parameters on meta, buffers real;
``peer``: the library's own ``from_pretrained`` with its tensor-parallel option), run the
case's fixed input and compare with the one-process reference the parent saved; a correct
shardwise load is then saved back with ``sw.save`` and compared with its source
(``_zoo_save.py``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import signal
import time
import traceback

import torch

RTOL = ATOL = 1e-4
_COLLECTIVE_FAULT = ("CollectiveError", "DistBackendError", "Timed out", "timed out", "Connection closed",
                     "Connection reset", "gloo", "StageTimeout")


class StageTimeout(Exception):
    """The task ran past its time limit on this rank (signal.alarm)."""


def _on_alarm(signum, frame):
    raise StageTimeout("ran past the per-family time limit")


@contextlib.contextmanager
def _time_limit(seconds: int):
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(max(1, int(seconds)))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _params_on_meta():
    """Fallback for ``sw.empty_model()``: parameters on meta, buffers real."""
    from torch import nn

    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            moved = type(param)(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            moved.__dict__.update(param.__dict__)
            param = moved
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _empty_model():
    import shardwise as sw

    try:
        return sw.empty_model()
    except AttributeError:  # an older checkout without sw.empty_model
        return _params_on_meta()


def _config(case):
    from _zoo_models import import_name

    cls = import_name(case.model_class)
    if case.library == "diffusers":
        return cls, cls.load_config(case.folder)
    from transformers import AutoConfig

    return cls, AutoConfig.from_pretrained(case.folder)


def _with_shardwise(case, mesh):
    import shardwise as sw

    cls, config = _config(case)
    with _empty_model():
        model = cls.from_config(config) if case.library == "diffusers" else cls(config)
    model.eval()
    plan = type(model)._tp_plan if case.library == "diffusers" else model.tp_plan
    sw.load(model, case.folder, plan=plan, mesh=mesh)
    return model


def _with_peer(case, tp: int, *, ep: bool = False):
    cls, _ = _config(case)
    if case.library == "diffusers":
        from diffusers import TensorParallelConfig

        return cls.from_pretrained(case.folder, parallel_config=TensorParallelConfig(tp_degree=tp)).eval()
    from transformers import DistributedConfig

    # ep: transformers 5.25's TP x EP, the experts split by its base_model_ep_plan over ep_size = tp
    # ranks (ep_size must be a multiple of tp_size), the attention by the TP plan
    sizes = {"tp_size": tp, "ep_size": tp} if ep else {"tp_size": tp}
    return cls.from_pretrained(case.folder, dtype=torch.float32,
                               distributed_config=DistributedConfig(tp_plan="auto", **sizes)).eval()


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """``status`` "pass" or "wrong", with the shapes and the largest difference."""
    from torch.distributed.tensor import DTensor

    note = ""
    if isinstance(out, DTensor):
        note = f" (a DTensor {tuple(out.placements)})"
        out = out.full_tensor()
    out = out.detach().float()
    if out.shape != ref.shape:
        return {"status": "wrong", "detail": f"output shape {list(out.shape)} != {list(ref.shape)}{note}"}
    diff = (out - ref.float()).abs().max().item() if out.numel() else 0.0
    if not torch.allclose(out, ref.float(), rtol=RTOL, atol=ATOL) or diff != diff:
        return {"status": "wrong", "detail": f"max |diff| {diff:.3g} vs one process{note}", "max_diff": diff}
    return {"status": "pass", "detail": note.strip(), "max_diff": diff}


def run_task(case, tool: str, tp: int, mesh, limit: int) -> dict:
    """Load ``case`` with ``tool`` on this rank, run the fixed input, compare. Never raises."""
    from _zoo_models import first_line, run_forward
    from _zoo_save import save_round_trip

    start = time.perf_counter()
    model = None
    try:
        with _time_limit(limit):
            data = torch.load(os.path.join(case.folder, "reference.pt"), weights_only=False)
            model = (_with_shardwise(case, mesh) if tool == "shardwise"
                     else _with_peer(case, tp, ep=tool == "peer_ep"))
            _, out = run_forward(model, case.library, data["inputs"])
            result = compare(out, data["reference"])
            if tool == "shardwise" and result["status"] == "pass":  # then it must save back exactly
                saved = save_round_trip(case, model, data, compare)
                result["save"] = saved["status"]
                if saved["status"] != "pass":
                    result.update(saved)
    except BaseException as e:  # noqa: BLE001 - every failure is a row of the report
        if isinstance(e, KeyboardInterrupt):
            raise
        result = {"status": "error", "detail": first_line(e), "trace": traceback.format_exc(limit=-4)}
    del model
    gc.collect()
    result["seconds"] = round(time.perf_counter() - start, 2)
    result["collective_fault"] = result["status"] == "error" and any(
        s in result.get("trace", "") for s in _COLLECTIVE_FAULT)
    return result


def quiet_libraries() -> None:
    """No progress bars, no hub access, only errors from transformers/diffusers logging."""
    import warnings

    os.environ.update({"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "1",
                       "TRANSFORMERS_VERBOSITY": "error", "DIFFUSERS_VERBOSITY": "error"})
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def rank_main(rank: int, world: int, port: int, tasks, results, limit: int) -> None:
    """One rank: join the gloo world, then run tasks until a ``None`` arrives.

    The environment is torchrun's, so that transformers finds the world it expects."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    quiet_libraries()
    import shardwise as sw

    backend = sw.init_backend("gloo", timeout=limit)
    mesh = backend.mesh(tp=world)
    results.put((rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        case, tool = task
        results.put((rank, (case.family, tool), run_task(case, tool, world, mesh, limit)))
    sw.shutdown_backend()


class RankPool:
    """``tp`` rank processes fed task by task; restarted after a hang, a death or a collective fault."""

    def __init__(self, tp: int, limit: int, *, log=print):
        import multiprocessing as mp

        self.tp, self.limit, self.log = tp, limit, log
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "torch.distributed", "transformers"])
        self.procs: list = []
        self.restarts = 0

    def start(self) -> None:
        from shardwise.testing import free_port

        self.results = self.ctx.Queue()
        self.tasks = [self.ctx.Queue() for _ in range(self.tp)]
        port = free_port()
        self.procs = [self.ctx.Process(target=rank_main, name=f"zoo-rank{r}", daemon=True,
                                       args=(r, self.tp, port, self.tasks[r], self.results, self.limit))
                      for r in range(self.tp)]
        for p in self.procs:
            p.start()
        ready = self._collect("ready", deadline=time.monotonic() + 180)
        if len(ready) < self.tp:
            self.stop()
            raise RuntimeError(f"zoo ranks did not start: {ready}")

    def stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        self.procs = []

    def close(self) -> None:
        for q in self.tasks if self.procs else ():
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
        self.stop()

    def run(self, case, tool: str) -> list[dict]:
        """Every rank's result for ``(case, tool)``; a missing rank gets a "hang" result."""
        if not self.procs:
            self.start()
        for q in self.tasks:
            q.put((case, tool))
        got = self._collect((case.family, tool), deadline=time.monotonic() + self.limit + 20)
        out = []
        for r in range(self.tp):
            out.append(got.get(r) or {"status": "hang", "seconds": self.limit,
                                      "detail": f"rank {r} gave no result in time (killed; a collective "
                                                f"left waiting, or past the {self.limit} s limit)"})
        if len(got) < self.tp or any(o.get("collective_fault") for o in out):
            self.log(f"  restarting the ranks after {case.family}/{tool}")
            self.stop()
            self.restarts += 1
        return out

    def _collect(self, key, *, deadline: float) -> dict[int, dict]:
        got: dict[int, dict] = {}
        first_error = None
        while len(got) < self.tp:
            now = time.monotonic()
            if now > deadline or any(p.exitcode is not None for p in self.procs):
                break
            # One rank failed while another still waits in a collective it will never
            # complete: give it a short grace, then treat it as hung.
            if first_error is not None and now > first_error + 30:
                break
            try:
                rank, k, payload = self.results.get(timeout=0.5)
            except queue.Empty:
                continue
            if k == key:
                got[rank] = payload
                if payload and payload.get("status") == "error" and first_error is None:
                    first_error = now
        return got
