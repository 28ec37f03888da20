"""The command line's rough edges: --version, argument errors, a compact plan, a quiet exit
into `head`, consolidate's summary and refusals that name the flag."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import shardwise as sw
from shardwise.cli import main
from shardwise.io.check import compact_plan

SRC = Path(__file__).resolve().parents[2] / "src"


def _run_cli(*args: str, stdin=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "shardwise", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"shardwise {sw.__version__}"


@pytest.mark.parametrize("args, message", [
    (["--tp", "3"], r"--tp: 3 does not divide the 8 KV heads of the small model; "
                    r"choose one of 1, 2, 4, 8"),
    (["--tp", "0"], r"--tp: 0 is not a positive number of ranks"),
    (["--tp", "two"], r"--tp: 'two' is not a whole number"),
    (["--size", "huge"], r"--size: invalid choice: 'huge'"),
])
def test_demo_arguments_are_argparse_errors(capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", *args])
    assert exit_.value.code == 2  # argparse's usage error, before any rank is spawned
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(message, err), err
    assert err.startswith("usage: shardwise demo")


def test_compact_plan_one_line_per_pattern():
    plan = {f"model.layers.{i}.self_attn.{p}": s for i in range(32)
            for p, s in (("q_proj", "colwise"), ("o_proj", "rowwise"))}
    plan["lm_head"] = "colwise_gather_output"
    lines = compact_plan(plan)
    assert lines == ["plan: 65 modules in 3 pattern(s)",
                     "  model.layers.*.self_attn.q_proj: colwise x32",
                     "  model.layers.*.self_attn.o_proj: rowwise x32",
                     "  lm_head: colwise_gather_output"]
    assert compact_plan({}) == []


def test_inspect_into_head_exits_quietly(tmp_path):
    # More than a pipe buffer of output, so the writer meets the closed pipe mid-way.
    path = tmp_path / "many.safetensors"
    save_file({f"layers.{i}.mlp.a_rather_long_projection_name.weight": torch.zeros(1)
               for i in range(3000)}, str(path))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "shardwise", "inspect", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does once it has its line
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert first.decode().startswith(str(path))
    assert err == "", err
    assert proc.returncode == 141


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4, bias=False)


def test_consolidate_summary_and_refusals(tmp_path):
    sw.save(Small(), tmp_path / "dcp", distributed=True)
    (tmp_path / "dcp" / "config.json").write_text('{"model_type": "small"}')  # a side file travels
    out = _run_cli("consolidate", str(tmp_path / "dcp"), str(tmp_path / "merged"))
    assert out.returncode == 0, out.stderr
    nbytes = sum(t.numel() * t.element_size() for t in Small().state_dict().values())
    assert re.fullmatch(rf"wrote {re.escape(str(tmp_path / 'merged'))}: 3 tensors, {nbytes} bytes in 1 "
                        r"file\(s\), [\d.]+ s\n", out.stdout), out.stdout
    assert (tmp_path / "merged" / "config.json").read_text() == '{"model_type": "small"}'

    again = _run_cli("consolidate", str(tmp_path / "dcp"), str(tmp_path / "merged"))
    assert again.returncode == 1 and "--overwrite" in again.stderr and "overwrite=True" not in again.stderr
    # overwrite replaces a folder that holds a Hugging Face checkpoint's side files too
    forced = _run_cli("consolidate", str(tmp_path / "dcp"), str(tmp_path / "merged"), "--overwrite")
    assert forced.returncode == 0, forced.stderr

    plain = _run_cli("consolidate", str(tmp_path / "merged"), str(tmp_path / "again"))
    assert plain.returncode == 1 and "Traceback" not in plain.stderr
    assert "is already a safetensors checkpoint" in plain.stderr and "nothing to do" in plain.stderr
    assert not (tmp_path / "again").exists()


def test_numpy_is_a_dependency():
    # torch's CPU wheel brings no NumPy; without it every command warns ("Failed to initialize
    # NumPy") and DCP's object collectives fail, so the package must pull it in.
    from importlib.metadata import requires

    assert any(r.split(";")[0].strip() == "numpy" for r in requires("shardwise") or [])


@pytest.mark.parametrize("verb", [[], ["demo"], ["inspect"], ["consolidate"], ["verify"], ["diff"],
                                  ["validate"]])
def test_help_shows_no_restructuredtext_markup(verb, capsys):
    with pytest.raises(SystemExit):
        main([*verb, "--help"])
    out = capsys.readouterr().out
    assert "usage: shardwise" in out and "``" not in out, out


def test_tqdm_is_a_dependency():
    # the progress bar is tqdm's: an optional extra left it off the installs that wanted it
    import tomllib

    project = tomllib.loads((SRC.parent / "pyproject.toml").read_text())["project"]
    assert any(re.match(r"tqdm\b", r) for r in project["dependencies"]), project["dependencies"]


def test_help_and_the_file_commands_parse_without_torch():
    """Issue #44: `shardwise --help` took 4-5 s importing torch; import shardwise needs none, and
    only demo and validate (whose options name the demo's sizes and the suite's) load it to parse."""
    code = ("import sys\nfrom shardwise.cli import build_parser\n"
            "build_parser('verify').parse_args(['verify', 'x'])\n"
            "try:\n    build_parser('').parse_args(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("False"), out.stdout
    assert "verify" in out.stdout and "validate" in out.stdout  # the help lists every command
